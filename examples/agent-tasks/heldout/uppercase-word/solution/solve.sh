#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
cat word.txt
tr a-z A-Z < word.txt > upper.txt
