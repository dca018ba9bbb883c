#!/usr/bin/env bash
# Reward 1 when /app/sorted.txt holds the five names in order, else 0.
mkdir -p /logs/verifier
if [ -f /app/sorted.txt ] && [ "$(cat /app/sorted.txt)" = "$(printf 'alice\nbob\ncarol\nmallory\ntrent')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
