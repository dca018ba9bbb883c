#!/usr/bin/env bash
# Reward 1 when table/results.txt is a copy of the untouched results.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f table/results.txt ] && [ "$(cat table/results.txt)" = "$(printf %s 'lima
echo
oscar')" ] && [ -f results.txt ] && [ "$(cat results.txt)" = "$(printf %s 'lima
echo
oscar')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
