#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
cat table.txt
sort table.txt > memo.txt
