#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
cat values.txt
mkdir report
cp values.txt report/
