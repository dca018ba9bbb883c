#!/usr/bin/env bash
# Reward 1 when report.txt ends with the line entries, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f report.txt ] && [ "$(cat report.txt)" = "$(printf %s 'hotel
golf
delta
entries')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
