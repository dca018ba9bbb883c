#!/usr/bin/env bash
# Reward 1 when entries.txt ends with the line values, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f entries.txt ] && [ "$(cat entries.txt)" = "$(printf %s 'sierra
bravo
delta
values')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
