#!/usr/bin/env bash
# Reward 1 when backup/config.ini is an exact copy of the untouched config.ini, else 0.
mkdir -p /logs/verifier
if [ -d /app/backup ] && cmp -s /app/config.ini /app/backup/config.ini && [ "$(cat /app/config.ini)" = "$(printf '[server]\nport = 8080')" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
