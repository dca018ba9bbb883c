#!/usr/bin/env bash
# Reward 1 when values/labels.txt is a copy of the untouched labels.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f values/labels.txt ] && [ "$(cat values/labels.txt)" = "$(printf %s 'papa
kilo
golf')" ] && [ -f labels.txt ] && [ "$(cat labels.txt)" = "$(printf %s 'papa
kilo
golf')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
