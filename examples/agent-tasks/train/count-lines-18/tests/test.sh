#!/usr/bin/env bash
# Reward 1 when data.txt holds 9, whitespace ignored, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f data.txt ] && [ "$(tr -d "[:space:]" < data.txt)" = "9" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
