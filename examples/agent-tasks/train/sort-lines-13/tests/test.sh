#!/usr/bin/env bash
# Reward 1 when numbers.txt holds the lines of items.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f numbers.txt ] && [ "$(cat numbers.txt)" = "$(printf %s 'delta
echo
oscar')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
