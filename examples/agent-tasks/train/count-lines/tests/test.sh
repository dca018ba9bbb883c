#!/usr/bin/env bash
# Reward 1 when /app/count.txt holds 7 (whitespace ignored), else 0.
mkdir -p /logs/verifier
if [ -f /app/count.txt ] && [ "$(tr -d '[:space:]' < /app/count.txt)" = "7" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
