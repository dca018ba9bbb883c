#!/usr/bin/env bash
# Reward 1 when results.txt holds 5, whitespace ignored, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f results.txt ] && [ "$(tr -d "[:space:]" < results.txt)" = "5" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
