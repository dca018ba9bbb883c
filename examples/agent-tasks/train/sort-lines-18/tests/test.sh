#!/usr/bin/env bash
# Reward 1 when values.txt holds the lines of labels.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f values.txt ] && [ "$(cat values.txt)" = "$(printf %s 'alpha
bravo
kilo
oscar
sierra')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
