#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
cat report.txt
mkdir results
cp report.txt results/
