#!/usr/bin/env bash
# Install Debian's chromium for the viewer's browser tests (tests/test_viewer_browser.py), once.
# Needs root and apt-get; otherwise it says so and those tests skip, naming the reason.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: apt-get install chromium"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
        || echo "install_browser: could not install chromium; the viewer's browser tests will skip" >&2
else
    echo "install_browser: chromium missing (needs root to apt-get install it); the viewer's browser tests will skip" >&2
fi
