#!/usr/bin/env bash
# Reward 1 when labels/values.txt is a copy of the untouched values.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f labels/values.txt ] && [ "$(cat labels/values.txt)" = "$(printf %s 'hotel
oscar
echo')" ] && [ -f values.txt ] && [ "$(cat values.txt)" = "$(printf %s 'hotel
oscar
echo')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
