#!/usr/bin/env bash
# Reward 1 when names.txt ends with the line data, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f names.txt ] && [ "$(cat names.txt)" = "$(printf %s 'kilo
india
papa
data')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
