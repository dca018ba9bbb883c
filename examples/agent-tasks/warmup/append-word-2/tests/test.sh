#!/usr/bin/env bash
# Reward 1 when table.txt ends with the line labels, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f table.txt ] && [ "$(cat table.txt)" = "$(printf %s 'alpha
oscar
kilo
labels')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
