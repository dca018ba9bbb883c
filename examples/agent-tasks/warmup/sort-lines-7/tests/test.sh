#!/usr/bin/env bash
# Reward 1 when labels.txt holds the lines of values.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f labels.txt ] && [ "$(cat labels.txt)" = "$(printf %s 'bravo
echo
sierra')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
