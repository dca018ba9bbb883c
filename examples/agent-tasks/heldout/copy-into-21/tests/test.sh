#!/usr/bin/env bash
# Reward 1 when names/items.txt is a copy of the untouched items.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f names/items.txt ] && [ "$(cat names/items.txt)" = "$(printf %s 'alpha
golf
bravo')" ] && [ -f items.txt ] && [ "$(cat items.txt)" = "$(printf %s 'alpha
golf
bravo')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
