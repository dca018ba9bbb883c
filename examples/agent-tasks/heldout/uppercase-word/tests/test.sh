#!/usr/bin/env bash
# Reward 1 when /app/upper.txt holds HARNESS, else 0.
mkdir -p /logs/verifier
if [ -f /app/upper.txt ] && [ "$(cat /app/upper.txt)" = "HARNESS" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
