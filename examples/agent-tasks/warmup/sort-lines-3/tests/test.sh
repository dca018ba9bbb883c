#!/usr/bin/env bash
# Reward 1 when entries.txt holds the lines of report.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f entries.txt ] && [ "$(cat entries.txt)" = "$(printf %s 'alpha
delta
golf
lima')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
