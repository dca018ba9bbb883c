#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
mv draft.txt final.txt
echo approved >> final.txt
