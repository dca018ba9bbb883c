#!/usr/bin/env bash
# Reward 1 when values/results.txt is a copy of the untouched results.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f values/results.txt ] && [ "$(cat values/results.txt)" = "$(printf %s 'golf
kilo
bravo')" ] && [ -f results.txt ] && [ "$(cat results.txt)" = "$(printf %s 'golf
kilo
bravo')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
