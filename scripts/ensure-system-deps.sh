#!/usr/bin/env bash
# Installs the Debian library Mooncake's transfer engine needs at import time (libibverbs1), if missing.
set -euo pipefail
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "libibverbs1 is missing; install it: sudo apt-get install -y libibverbs1" >&2
  exit 1
fi
echo "installing libibverbs1 (needed by Mooncake)..." >&2
apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; }
