#!/usr/bin/env bash
# Reward 1 when results/entries.txt is a copy of the untouched entries.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f results/entries.txt ] && [ "$(cat results/entries.txt)" = "$(printf %s 'india
bravo
hotel')" ] && [ -f entries.txt ] && [ "$(cat entries.txt)" = "$(printf %s 'india
bravo
hotel')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
