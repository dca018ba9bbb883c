#!/usr/bin/env bash
# Reward 1 when numbers.txt holds 4, whitespace ignored, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f numbers.txt ] && [ "$(tr -d "[:space:]" < numbers.txt)" = "4" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
