"""Shared helpers for the benchmark scripts: timing whole commands, medians, streams."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PTCLUSTER = [str(BIN / "ptcluster")]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# The benchmarks write their own cluster files, with the testbed's ssh config in them: files
# they trust (without it every testbed benchmark stopped at the cluster-file check).
os.environ.setdefault("PTCLUSTER_TRUST_CLUSTER_FILE", "1")


def timed(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n{proc.stdout[-2000:]}"
                         f"\n{proc.stderr[-2000:]}")
    return took


def time_to_line(argv: list[str], cwd: Path, predicate,
                 timeout: float = 600) -> tuple[float, str]:
    """(seconds from start, the line) for the first stdout line that satisfies ``predicate``;
    the run is then ended."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if predicate(line):
                return time.perf_counter() - t0, line
            if time.perf_counter() - t0 > timeout:
                break
        raise SystemExit(f"never reached the target: {' '.join(argv)}")
    finally:
        if proc.poll() is None:
            import signal
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


def median(values: list[float]) -> float:
    return statistics.median(values)


def show(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def ssh_only(bed: Any, k: int, identity: Path | None = None) -> float:
    """Seconds for k parallel `ssh node true` on a testbed (connect, authenticate, run
    nothing): the floor of any fan-out over ssh there. ``identity``: the key to log in with
    (bare nodes know only the one setup installed)."""
    key = ["-i", str(identity)] if identity else []
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["ssh", "-F", str(bed.ssh_config), *key, "-T", node.name, "true"],
                              stdin=subprocess.DEVNULL) for node in bed.nodes[:k]]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("ssh to a testbed node failed")
    return time.perf_counter() - t0


def cpu() -> float:
    """This process's CPU seconds so far (user + system)."""
    t = os.times()
    return t.user + t.system


def proc_status() -> tuple[int, int, int]:
    """This process's resident memory (KiB), threads and open descriptors now."""
    rss = threads = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, threads, len(os.listdir("/proc/self/fd"))


def last_json(argv: list[str], cwd: Path, preexec_fn: Any = None,
              **fields: Any) -> dict[str, Any]:
    """Run a benchmark's one measurement in a fresh process: its last stdout line, as JSON;
    on a failure ``fields`` plus the ``cause`` (the last line of its stderr)."""
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=1800,
                          preexec_fn=preexec_fn)
    last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    if proc.returncode != 0 or not last:
        return {**fields, "cause": (proc.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(last[0])


def core_share(samples: list[tuple[float, ...]], seconds: float) -> float:
    """% of one core a process used between its second and last samples ``(wall, cpu,
    ...)`` (the first is its start-up); SystemExit when there are too few to measure."""
    steady = samples[1:]
    if len(steady) < 2:
        raise SystemExit(f"too short to measure: {len(samples)} samples in {seconds} s")
    return 100 * (steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])
