#!/usr/bin/env bash
# Reward 1 when data/labels.txt is a copy of the untouched labels.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f data/labels.txt ] && [ "$(cat data/labels.txt)" = "$(printf %s 'delta
echo
bravo')" ] && [ -f labels.txt ] && [ "$(cat labels.txt)" = "$(printf %s 'delta
echo
bravo')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
