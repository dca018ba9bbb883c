#!/usr/bin/env bash
# Reward 1 when report/names.txt is a copy of the untouched names.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f report/names.txt ] && [ "$(cat report/names.txt)" = "$(printf %s 'oscar
sierra
echo')" ] && [ -f names.txt ] && [ "$(cat names.txt)" = "$(printf %s 'oscar
sierra
echo')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
