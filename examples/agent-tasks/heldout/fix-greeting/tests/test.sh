#!/usr/bin/env bash
# Reward 1 when python3 greet.py prints good morning, else 0.
mkdir -p /logs/verifier
if [ "$(cd /app && python3 greet.py)" = "good morning" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
