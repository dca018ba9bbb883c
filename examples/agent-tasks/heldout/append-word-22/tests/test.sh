#!/usr/bin/env bash
# Reward 1 when words.txt ends with the line names, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f words.txt ] && [ "$(cat words.txt)" = "$(printf %s 'lima
papa
hotel
names')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
