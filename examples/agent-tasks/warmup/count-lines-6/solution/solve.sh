#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
wc -l values.txt
wc -l < values.txt > report.txt
