#!/usr/bin/env bash
# Reward 1 when words/values.txt is a copy of the untouched values.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f words/values.txt ] && [ "$(cat words/values.txt)" = "$(printf %s 'lima
oscar
delta')" ] && [ -f values.txt ] && [ "$(cat values.txt)" = "$(printf %s 'lima
oscar
delta')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
