#!/usr/bin/env bash
# Reward 1 when memo.txt holds the lines of table.txt in order, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f memo.txt ] && [ "$(cat memo.txt)" = "$(printf %s 'hotel
kilo
lima
papa')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
