#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
cat calc.py
sed -i 's/x + x + 1/2 * x/' calc.py
