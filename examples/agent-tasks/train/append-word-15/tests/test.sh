#!/usr/bin/env bash
# Reward 1 when labels.txt ends with the line report, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f labels.txt ] && [ "$(cat labels.txt)" = "$(printf %s 'bravo
india
delta
report')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
