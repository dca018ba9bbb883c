#!/usr/bin/env bash
# Reward 1 when numbers/values.txt is a copy of the untouched values.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f numbers/values.txt ] && [ "$(cat numbers/values.txt)" = "$(printf %s 'golf
kilo
bravo')" ] && [ -f values.txt ] && [ "$(cat values.txt)" = "$(printf %s 'golf
kilo
bravo')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
