#!/usr/bin/env bash
# Reward 1 when items.txt holds the lines of report.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f items.txt ] && [ "$(cat items.txt)" = "$(printf %s 'bravo
delta
golf
hotel
india
lima')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
