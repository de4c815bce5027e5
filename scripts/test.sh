#!/usr/bin/env bash
# Set up everything the tests need, run ruff and mypy, then the tests. Extra arguments go to
# pytest.
# As root it installs the multi-node testbed's system packages (openssh-server, iproute2,
# nftables), a real Slurm (slurm-wlm, munge: the daemons are started by the tests, inside
# the testbed's nodes), and for the bare nodes sudo, ufw, rsync and a local apt repo and
# wheelhouse (scripts/prepare_testbed.sh); without root the testbed tests skip with the
# reason (in CI they must run).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ]; then
  missing=""
  command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing="$missing openssh-server"
  command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
  command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || missing="$missing nftables"
  command -v ssh >/dev/null 2>&1 || missing="$missing openssh-client"
  # sync lists a checkout's files with git; its tests make repositories (a CI checkout made
  # without git, e.g. from a tarball, would not have it)
  command -v git >/dev/null 2>&1 || missing="$missing git"
  command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || missing="$missing slurm-wlm"
  command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || missing="$missing munge"
  # the real Prometheus that scrapes `monitor --serve` in its testbed test (started by the
  # test on a free localhost port; never by apt: the policy-rc.d below)
  command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"
  # the bare-node testbed (setup, sync): what its nodes get from this machine's root, and the
  # tools that build their apt repository
  # the systemd-nspawn nodes (setup --slurm): their root is built by debootstrap (prepare_testbed.sh)
  for tool in sudo:sudo ufw:ufw rsync:rsync dpkg-repack:dpkg-repack dpkg-scanpackages:dpkg-dev \
      systemd-nspawn:systemd-container debootstrap:debootstrap; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${tool%%:*}" ] \
      || missing="$missing ${tool#*:}"
  done
  dpkg-query -W -f '${Status}' python3-venv 2>/dev/null | grep -q "ok installed" \
    || missing="$missing python3-venv"
  if [ -n "$missing" ]; then
    export DEBIAN_FRONTEND=noninteractive
    # apt must not start munge/slurm daemons on this machine (the tests start their own, in
    # the testbed's nodes): a policy-rc.d that refuses every start, only while we install.
    made_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
      chmod 755 /usr/sbin/policy-rc.d
      made_policy=1
      trap 'rm -f /usr/sbin/policy-rc.d' EXIT  # also when the install fails
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
    if [ -n "$made_policy" ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
  fi
fi
bash scripts/setup.sh
if [ "$(id -u)" = 0 ]; then
  bash scripts/prepare_testbed.sh
fi
# Lint and types fail the run like a test does, and first (they take seconds).
.venv/bin/ruff check .
.venv/bin/mypy src
# The docs site, strictly: a broken link, a missing page or a reference page that no longer
# renders fails the run (the pages' commands run in tests/unit/test_docs.py).
site_dir="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site_dir"
rm -rf "$site_dir"
exec .venv/bin/python -m pytest "$@"
