#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
cat labels.txt
mkdir names
cp labels.txt names/
