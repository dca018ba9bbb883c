#!/usr/bin/env bash
# Reward 1 when results/data.txt is a copy of the untouched data.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f results/data.txt ] && [ "$(cat results/data.txt)" = "$(printf %s 'bravo
alpha
india')" ] && [ -f data.txt ] && [ "$(cat data.txt)" = "$(printf %s 'bravo
alpha
india')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
