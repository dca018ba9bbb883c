#!/usr/bin/env bash
# Reward 1 when results.txt ends with the line words, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f results.txt ] && [ "$(cat results.txt)" = "$(printf %s 'delta
india
bravo
words')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
