#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
cat notes.txt
sed -i 's/helo/hello/' notes.txt
