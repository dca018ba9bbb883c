#!/usr/bin/env bash
# Reward 1 when memo.txt holds 3, whitespace ignored, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f memo.txt ] && [ "$(tr -d "[:space:]" < memo.txt)" = "3" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
