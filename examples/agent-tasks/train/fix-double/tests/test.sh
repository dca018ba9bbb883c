#!/usr/bin/env bash
# Reward 1 when double(n) == 2 * n for several n, else 0.
mkdir -p /logs/verifier
if cd /app && python3 -c 'from calc import double; assert [double(n) for n in (0, 1, 5, -3)] == [0, 2, 10, -6]'; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
