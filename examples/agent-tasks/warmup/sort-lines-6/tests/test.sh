#!/usr/bin/env bash
# Reward 1 when entries.txt holds the lines of names.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f entries.txt ] && [ "$(cat entries.txt)" = "$(printf %s 'alpha
delta
golf
hotel
lima
oscar')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
