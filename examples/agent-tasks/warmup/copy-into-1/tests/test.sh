#!/usr/bin/env bash
# Reward 1 when names/labels.txt is a copy of the untouched labels.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f names/labels.txt ] && [ "$(cat names/labels.txt)" = "$(printf %s 'alpha
lima
golf')" ] && [ -f labels.txt ] && [ "$(cat labels.txt)" = "$(printf %s 'alpha
lima
golf')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
