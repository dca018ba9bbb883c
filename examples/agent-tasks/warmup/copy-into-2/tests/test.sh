#!/usr/bin/env bash
# Reward 1 when entries/words.txt is a copy of the untouched words.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f entries/words.txt ] && [ "$(cat entries/words.txt)" = "$(printf %s 'hotel
oscar
echo')" ] && [ -f words.txt ] && [ "$(cat words.txt)" = "$(printf %s 'hotel
oscar
echo')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
