#!/usr/bin/env bash
# Install iproute2 (`ip`, `tc`) for the emulated cluster (flashsgd bench emulate, issue 7).
# Does nothing when both tools are already present; needs root (apt-get) otherwise.
# Usage: scripts/install_iproute2.sh    (called from scripts/setup.sh)
set -euo pipefail
if command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; then
    echo "iproute2: present ($(ip -V 2>&1 | head -n1))"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "iproute2: 'ip'/'tc' missing and not root: install iproute2 as root to use 'flashsgd bench emulate'" >&2
    exit 0   # optional feature: do not fail the whole set-up
fi
if command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2
elif command -v dnf >/dev/null 2>&1; then
    dnf install -y iproute iproute-tc
elif command -v apk >/dev/null 2>&1; then
    apk add --no-cache iproute2
else
    echo "iproute2: no known package manager; install iproute2 by hand" >&2
    exit 0
fi
echo "iproute2: installed ($(ip -V 2>&1 | head -n1))"
