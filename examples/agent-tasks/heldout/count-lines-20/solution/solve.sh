#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
wc -l data.txt
wc -l < data.txt > words.txt
