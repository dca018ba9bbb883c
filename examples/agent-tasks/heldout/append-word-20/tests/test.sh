#!/usr/bin/env bash
# Reward 1 when values.txt ends with the line items, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f values.txt ] && [ "$(cat values.txt)" = "$(printf %s 'delta
sierra
kilo
items')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
