#!/usr/bin/env bash
# Reward 1 when data.txt ends with the line items, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f data.txt ] && [ "$(cat data.txt)" = "$(printf %s 'papa
sierra
bravo
items')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
