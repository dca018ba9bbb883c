#!/usr/bin/env bash
# Reward 1 when report/words.txt is a copy of the untouched words.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f report/words.txt ] && [ "$(cat report/words.txt)" = "$(printf %s 'sierra
bravo
hotel')" ] && [ -f words.txt ] && [ "$(cat words.txt)" = "$(printf %s 'sierra
bravo
hotel')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
