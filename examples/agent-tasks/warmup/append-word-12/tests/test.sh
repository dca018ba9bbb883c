#!/usr/bin/env bash
# Reward 1 when numbers.txt ends with the line values, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f numbers.txt ] && [ "$(cat numbers.txt)" = "$(printf %s 'oscar
echo
papa
values')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
