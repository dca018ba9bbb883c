#!/usr/bin/env bash
# Reward 1 when old.log is gone from /app and archive/old.log holds its lines, else 0.
mkdir -p /logs/verifier
if [ ! -e /app/old.log ] && [ "$(cat /app/archive/old.log)" = "$(printf 'started\nstopped')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
