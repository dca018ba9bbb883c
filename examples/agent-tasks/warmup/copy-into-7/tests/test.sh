#!/usr/bin/env bash
# Reward 1 when entries/results.txt is a copy of the untouched results.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f entries/results.txt ] && [ "$(cat entries/results.txt)" = "$(printf %s 'kilo
lima
golf')" ] && [ -f results.txt ] && [ "$(cat results.txt)" = "$(printf %s 'kilo
lima
golf')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
