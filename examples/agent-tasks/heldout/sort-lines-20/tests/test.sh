#!/usr/bin/env bash
# Reward 1 when report.txt holds the lines of values.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f report.txt ] && [ "$(cat report.txt)" = "$(printf %s 'echo
golf
india
kilo
lima
oscar')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
