#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
cat results.txt
mkdir values
cp results.txt values/
