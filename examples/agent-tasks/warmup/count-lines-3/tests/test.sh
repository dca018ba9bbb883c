#!/usr/bin/env bash
# Reward 1 when items.txt holds 8, whitespace ignored, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f items.txt ] && [ "$(tr -d "[:space:]" < items.txt)" = "8" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
