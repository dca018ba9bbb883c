#!/usr/bin/env bash
# Reward 1 when /app/plan.txt holds the three step lines and nothing else, else 0.
mkdir -p /logs/verifier
if [ "$(cat /app/plan.txt)" = "$(printf 'step one\nstep two\nstep three')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
