#!/usr/bin/env bash
# Reward 1 when /app/hello.sh is executable and prints hello, else 0.
mkdir -p /logs/verifier
if [ -x /app/hello.sh ] && [ "$(cd /app && ./hello.sh)" = "hello" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
