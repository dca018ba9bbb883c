#!/usr/bin/env bash
# Reward 1 when results/report.txt is a copy of the untouched report.txt, else 0.
mkdir -p /logs/verifier
cd /app
if [ -f results/report.txt ] && [ "$(cat results/report.txt)" = "$(printf %s 'papa
india
lima')" ] && [ -f report.txt ] && [ "$(cat report.txt)" = "$(printf %s 'papa
india
lima')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
