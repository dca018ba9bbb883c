#!/usr/bin/env bash
# Reward 1 when results/words.txt is a copy of the untouched words.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f results/words.txt ] && [ "$(cat results/words.txt)" = "$(printf %s 'echo
sierra
oscar')" ] && [ -f words.txt ] && [ "$(cat words.txt)" = "$(printf %s 'echo
sierra
oscar')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
