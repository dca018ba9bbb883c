#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
cat words.txt
mkdir results
cp words.txt results/
