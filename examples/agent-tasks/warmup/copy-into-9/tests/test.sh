#!/usr/bin/env bash
# Reward 1 when entries/values.txt is a copy of the untouched values.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f entries/values.txt ] && [ "$(cat entries/values.txt)" = "$(printf %s 'hotel
echo
sierra')" ] && [ -f values.txt ] && [ "$(cat values.txt)" = "$(printf %s 'hotel
echo
sierra')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
