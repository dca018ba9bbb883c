#!/usr/bin/env bash
# Reward 1 when names.txt holds the lines of labels.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f names.txt ] && [ "$(cat names.txt)" = "$(printf %s 'alpha
delta
echo
golf
hotel
papa')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
