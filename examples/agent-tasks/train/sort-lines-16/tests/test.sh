#!/usr/bin/env bash
# Reward 1 when entries.txt holds the lines of table.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f entries.txt ] && [ "$(cat entries.txt)" = "$(printf %s 'alpha
echo
lima
oscar
papa
sierra')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
