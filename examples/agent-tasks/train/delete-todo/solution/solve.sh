#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
grep -n TODO plan.txt
sed -i '/TODO/d' plan.txt
