#!/usr/bin/env bash
# Reward 1 when memo/results.txt is a copy of the untouched results.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f memo/results.txt ] && [ "$(cat memo/results.txt)" = "$(printf %s 'golf
delta
bravo')" ] && [ -f results.txt ] && [ "$(cat results.txt)" = "$(printf %s 'golf
delta
bravo')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
