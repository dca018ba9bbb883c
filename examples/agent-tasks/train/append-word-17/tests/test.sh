#!/usr/bin/env bash
# Reward 1 when table.txt ends with the line report, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f table.txt ] && [ "$(cat table.txt)" = "$(printf %s 'bravo
hotel
alpha
report')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
