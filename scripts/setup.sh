#!/usr/bin/env bash
# Set up ptcluster in ./.venv (Python >= 3.10). torch is pinned for this install path only
# (constraints.txt): an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,digits,docs]"
# `monitor --serve` needs it, and no network at run time: checked here, where it is installed
.venv/bin/python -c "import prometheus_client" || { echo "prometheus_client did not install" >&2; exit 1; }
echo "ptcluster installed in .venv: $(.venv/bin/ptcluster --version)"
