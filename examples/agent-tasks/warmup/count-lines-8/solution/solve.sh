#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
wc -l table.txt
wc -l < table.txt > results.txt
