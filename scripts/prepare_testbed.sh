#!/usr/bin/env bash
# Artifacts the bare-node testbed needs, made at install time (as root, network allowed) so that
# nothing is downloaded while the tests run. Idempotent and quick when already there.
#   $PTC_TESTBED_CACHE/apt/     a `file:` apt repository: the packages the bare nodes lack
#                               (python3-venv, python3.X-venv, rsync), repacked from this machine's
#                               installed ones so their versions match its dpkg database exactly
#   $PTC_TESTBED_CACHE/wheels/  the head's wheelhouse source: torch (pinned) and ptcluster's deps
#   $PTC_TESTBED_CACHE/node-venv/  the system Python with that torch, installed from wheels/: the
#                               venv the bare nodes share in the several-users tests
#   $PTC_TESTBED_CACHE/nspawn/  the systemd-nspawn nodes' root (scripts/nspawn_template.sh: a
#                               bookworm minbase with systemd, sshd and a local apt repository
#                               holding munge and Slurm; ~1 min once, then cached)
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${PTC_TESTBED_CACHE:-/var/cache/ptcluster-testbed}"
PY="${1:-.venv/bin/python}"
mkdir -p "$CACHE/apt" "$CACHE/wheels"
pyver="$(/usr/bin/python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
pkgs="python3-venv python${pyver}-venv rsync"
stamp="$CACHE/apt/.made-from"
want="$(dpkg-query -W -f '${Package}=${Version} ' $pkgs)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -f "$CACHE/apt/Packages.gz" ]; then
  rm -f "$CACHE"/apt/*.deb
  (cd "$CACHE/apt" && dpkg-repack $pkgs >/dev/null 2>&1 &&
   dpkg-scanpackages --multiversion . /dev/null 2>/dev/null | gzip -9 > Packages.gz)
  echo "$want" > "$stamp"
fi
# The wheels for the nodes: the head downloads them into its wheelhouse at test time with
# PIP_NO_INDEX=1 PIP_FIND_LINKS=$CACHE/wheels (an air-gapped head with a local mirror).
# What to fetch: torch and ptcluster's own dependencies as the installed package declares them,
# with those of the extras setup installs on the nodes (SELF_EXTRAS, src/ptcluster/setup/wheels.py:
# scikit-learn for the trainer's offline data); a dependency added to pyproject.toml is fetched
# on the next run: the list is the stamp.
deps="torch==2.13.0 $("$PY" -c 'import sys; sys.path.insert(0, "src")
import importlib.metadata as m
from ptcluster.setup.wheels import SELF_EXTRAS
def wanted(r): return "extra ==" not in r or any(f"extra == \"{e}\"" in r for e in SELF_EXTRAS)
print(" ".join(sorted({r.split(";")[0].replace(" ", "") for r in m.requires("ptcluster") or []
                       if wanted(r) and not r.startswith("torch")})))')"
if ! ls "$CACHE"/wheels/torch-2.13.0*.whl >/dev/null 2>&1 \
    || [ "$(cat "$CACHE/wheels/.complete" 2>/dev/null)" != "$deps" ]; then
  "$PY" -m pip download -q -c constraints.txt -d "$CACHE/wheels" $deps >/dev/null
  echo "$deps" > "$CACHE/wheels/.complete"
fi
# The nodes' shared venv (tests/support/bare.py node_venv; made once, ~1.5 min; kept while complete).
"$PY" -c 'import sys; sys.path.insert(0, "."); from tests.support.bare import node_venv; node_venv()'
# The systemd-nspawn nodes' template (tests/support/nspawn.py), where systemd-nspawn is there.
if command -v systemd-nspawn >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; then
  bash scripts/nspawn_template.sh
fi
