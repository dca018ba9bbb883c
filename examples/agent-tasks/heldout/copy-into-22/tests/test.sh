#!/usr/bin/env bash
# Reward 1 when items/names.txt is a copy of the untouched names.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f items/names.txt ] && [ "$(cat items/names.txt)" = "$(printf %s 'hotel
delta
sierra')" ] && [ -f names.txt ] && [ "$(cat names.txt)" = "$(printf %s 'hotel
delta
sierra')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
