#!/usr/bin/env bash
# Reward 1 when labels.txt holds 7, whitespace ignored, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f labels.txt ] && [ "$(tr -d "[:space:]" < labels.txt)" = "7" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
