#!/usr/bin/env bash
# Reward 1 when report/values.txt is a copy of the untouched values.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f report/values.txt ] && [ "$(cat report/values.txt)" = "$(printf %s 'kilo
oscar
hotel')" ] && [ -f values.txt ] && [ "$(cat values.txt)" = "$(printf %s 'kilo
oscar
hotel')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
