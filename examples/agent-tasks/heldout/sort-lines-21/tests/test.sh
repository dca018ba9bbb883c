#!/usr/bin/env bash
# Reward 1 when results.txt holds the lines of words.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f results.txt ] && [ "$(cat results.txt)" = "$(printf %s 'bravo
golf
hotel
kilo
lima')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
