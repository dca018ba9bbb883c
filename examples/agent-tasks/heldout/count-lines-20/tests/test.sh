#!/usr/bin/env bash
# Reward 1 when words.txt holds 6, whitespace ignored, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f words.txt ] && [ "$(tr -d "[:space:]" < words.txt)" = "6" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
