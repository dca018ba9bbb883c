#!/usr/bin/env bash
# Reward 1 when memo/words.txt is a copy of the untouched words.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f memo/words.txt ] && [ "$(cat memo/words.txt)" = "$(printf %s 'echo
delta
alpha')" ] && [ -f words.txt ] && [ "$(cat words.txt)" = "$(printf %s 'echo
delta
alpha')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
