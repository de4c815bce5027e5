#!/usr/bin/env bash
# Set up everything the tests need, run ruff and mypy, then the tests. Extra arguments go to
# pytest.
# As root it installs the multi-node testbed's system packages (openssh-server, iproute2,
# nftables); without root the testbed tests skip with the reason (in CI they must run).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ]; then
  missing=""
  command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing="$missing openssh-server"
  command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
  command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || missing="$missing nftables"
  command -v ssh >/dev/null 2>&1 || missing="$missing openssh-client"
  if [ -n "$missing" ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq $missing >/dev/null
  fi
fi
bash scripts/setup.sh
# Lint and types fail the run like a test does, and first (they take seconds).
.venv/bin/ruff check .
.venv/bin/mypy src
exec .venv/bin/python -m pytest "$@"
