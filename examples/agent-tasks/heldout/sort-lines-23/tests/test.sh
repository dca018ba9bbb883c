#!/usr/bin/env bash
# Reward 1 when data.txt holds the lines of table.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f data.txt ] && [ "$(cat data.txt)" = "$(printf %s 'delta
india
kilo')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
