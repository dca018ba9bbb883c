#!/usr/bin/env bash
# Reward 1 when data.txt ends with the line values, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f data.txt ] && [ "$(cat data.txt)" = "$(printf %s 'oscar
delta
hotel
values')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
