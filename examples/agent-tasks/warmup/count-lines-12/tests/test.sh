#!/usr/bin/env bash
# Reward 1 when table.txt holds 7, whitespace ignored, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f table.txt ] && [ "$(tr -d "[:space:]" < table.txt)" = "7" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
