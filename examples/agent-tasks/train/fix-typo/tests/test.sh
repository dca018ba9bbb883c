#!/usr/bin/env bash
# Reward 1 when /app/notes.txt holds exactly "hello world", else 0.
mkdir -p /logs/verifier
if [ "$(cat /app/notes.txt)" = "hello world" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
