#!/usr/bin/env bash
# Reward 1 when draft.txt is gone and final.txt holds its line followed by approved, else 0.
mkdir -p /logs/verifier
if [ ! -e /app/draft.txt ] && [ "$(cat /app/final.txt)" = "$(printf 'plan: ship it\napproved')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
