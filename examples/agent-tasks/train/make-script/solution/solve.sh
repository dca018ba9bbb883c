#!/usr/bin/env bash
# The reference solution, run in the task's workdir: one command per line, one agent tool call each.
printf '#!/bin/sh\necho hello\n' > hello.sh
chmod +x hello.sh
