#!/usr/bin/env bash
# Reward 1 when memo.txt ends with the line labels, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f memo.txt ] && [ "$(cat memo.txt)" = "$(printf %s 'golf
papa
bravo
labels')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
