#!/usr/bin/env bash
# Reward 1 when numbers/report.txt is a copy of the untouched report.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f numbers/report.txt ] && [ "$(cat numbers/report.txt)" = "$(printf %s 'delta
sierra
alpha')" ] && [ -f report.txt ] && [ "$(cat report.txt)" = "$(printf %s 'delta
sierra
alpha')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
