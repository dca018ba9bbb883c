#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
cat items.txt
mkdir names
cp items.txt names/
