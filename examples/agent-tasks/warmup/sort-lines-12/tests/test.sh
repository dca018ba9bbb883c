#!/usr/bin/env bash
# Reward 1 when numbers.txt holds the lines of entries.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f numbers.txt ] && [ "$(cat numbers.txt)" = "$(printf %s 'bravo
golf
india
kilo')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
