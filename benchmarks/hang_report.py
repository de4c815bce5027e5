"""Hang detection: how fast, what it costs.

(a) From the onset of a hang to the report (``hang-stacks.json`` written by the head): a
    2-rank job on the local cluster in which rank 1 goes to sleep before a collective, under
    ``ptcluster run --hang-timeout S``; target <= S + 5 s.
(b) The cost of a stack probe per rank: the guard's measure from the report (asked -> the
    rank's stacks in hand; in this job both ranks answer through their probe thread) and,
    in-process, faulthandler's dump of every thread into a file (what a rank whose GIL is held
    pays when it is signalled: its threads stop for that long); plus the guard's per-heartbeat
    progress sample (/proc of the rank trees).
(c) The reference trainer's samples/s with torch's flight recorder on (``TORCH_FR_BUFFER_SIZE``
    2000, ptcluster's default) vs off (0), 2 ranks under torchrun, alternated, medians; and, more
    sensitive, the recorder's cost per collective (µs per all_reduce of one float, world 1).

    .venv/bin/python benchmarks/hang_report.py [--timeout 5] [--repeat 3] [--epochs 3]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import PTCLUSTER, TORCHRUN, median, show

HANGS = """
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(3):
    dist.all_reduce(torch.ones(8))
    time.sleep(0.2)
if rank == 1:
    print(f"onset {time.time():.3f}", flush=True)
    time.sleep(600)
dist.all_reduce(torch.ones(8))
"""


def hang_latency(cwd: Path, timeout: float) -> tuple[float, list[float]]:
    """(seconds from the onset to the report, probe ms per rank)."""
    runs = cwd / f"runs-{time.monotonic_ns()}"
    proc = subprocess.run([*PTCLUSTER, "run", "--nproc", "2", "--run-dir", str(runs),
                           "--hang-timeout", str(timeout), "hangs.py"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 4:
        raise SystemExit(f"expected exit 4, got {proc.returncode}:\n{proc.stderr[-3000:]}")
    onset = float(re.search(r"onset ([\d.]+)", proc.stdout).group(1))
    (report,) = runs.glob("*/hang-stacks.json")
    data = json.loads(report.read_text())
    return data["at"] - onset, [r["probe_ms"] for r in data["ranks"] if r["probe_ms"]]


def dump_cost(threads: int, repeat: int = 200) -> float:
    """Median µs of faulthandler's all-threads dump into a file, ``threads`` extra threads
    parked a few frames deep."""
    stop = threading.Event()

    def parked(depth: int) -> None:
        if depth:
            parked(depth - 1)
        else:
            stop.wait()

    pool = [threading.Thread(target=parked, args=(8,), daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    with tempfile.TemporaryFile() as f:  # what the probe writes to: a file in the guard's dir
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            faulthandler.dump_traceback(file=f, all_threads=True)
            times.append((time.perf_counter() - t0) * 1e6)
    stop.set()
    return median(times)


def progress_sample_cost(repeat: int = 50) -> tuple[float, int]:
    """Median ms of one progress sample of the guard (a /proc scan) over this machine's
    processes, for two "ranks"."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from ptcluster.node.guard.progress import ProgressMeter, StackProbes

    probes = StackProbes()
    probes.started(0, os.getpid())
    probes.started(1, os.getppid())
    meter = ProgressMeter(probes)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        meter.sample()
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times), len([p for p in os.listdir("/proc") if p.isdigit()])


COLLECTIVE = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
t = torch.ones(1)
for _ in range(500):
    dist.all_reduce(t)
n, t0 = 20000, time.perf_counter()
for _ in range(n):
    dist.all_reduce(t)
print(f"us {(time.perf_counter() - t0) / n * 1e6:.2f}", flush=True)
dist.destroy_process_group()
"""


def collective_cost(cwd: Path, fr: str) -> float:
    """µs per all_reduce of one float in a world of 1 (gloo): what the recorder adds to each
    collective, without the network's noise."""
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": fr}
    store = cwd / f"store-{time.monotonic_ns()}"
    out = subprocess.run([sys.executable, "coll.py", str(store)], cwd=cwd, env=env,
                         capture_output=True, text=True, check=True).stdout
    return float(re.search(r"us ([\d.]+)", out).group(1))


def trainer_rate(cwd: Path, fr: str, epochs: int) -> float:
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": fr}
    out = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m",
                          "ptcluster.examples.mnist", "--dataset", "digits", "--epochs",
                          str(epochs), "--checkpoint-dir", str(cwd / f"ck-{fr}")],
                         cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"final .*samples_per_s=([\d.]+)", out).group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=5.0, help="the hang timeout S")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="epochs per trainer run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "hangs.py").write_text(HANGS)
        lat, probe_ms = [], []
        for _ in range(args.repeat):
            took, ms = hang_latency(cwd, args.timeout)
            lat.append(took)
            probe_ms += ms
        on, off, c_on, c_off = [], [], [], []
        (cwd / "coll.py").write_text(COLLECTIVE)
        for _ in range(args.repeat):
            off.append(trainer_rate(cwd, "0", args.epochs))
            on.append(trainer_rate(cwd, "2000", args.epochs))
            c_off.append(collective_cost(cwd, "0"))
            c_on.append(collective_cost(cwd, "2000"))
    sample_ms, nprocs = progress_sample_cost()
    s = args.timeout

    def runs(values: list[float]) -> str:
        return ", ".join(f"{x:.0f}" if x > 100 else f"{x:.1f}" for x in values)

    verdict = "ok" if median(lat) <= s + 5 else "MISSED"
    show([
        ("hang onset -> report (median)",
         f"{median(lat):.2f} s  (S = {s:.0f} s; target <= {s + 5:.0f} s: {verdict})"),
        ("  each run", ", ".join(f"{x:.2f}" for x in lat)),
        ("  over S", f"{median(lat) - s:.2f} s (ratio to S + 5: {median(lat) / (s + 5):.2f})"),
        ("probe, asked -> stack at the guard", f"median {median(probe_ms):.1f} ms, "
                                               f"max {max(probe_ms):.1f} ms per rank"),
        ("probe, rank side (dump, 1 thread)", f"{dump_cost(0):.0f} us"),
        ("probe, rank side (dump, 16 threads)", f"{dump_cost(16):.0f} us"),
        ("guard progress sample (/proc scan)", f"{sample_ms:.2f} ms per heartbeat "
                                               f"({nprocs} processes here)"),
        ("trainer samples/s, recorder off", f"{median(off):.0f}  ({runs(off)})"),
        ("trainer samples/s, recorder on", f"{median(on):.0f}  ({runs(on)})"),
        ("  on vs off", f"{(median(on) / median(off) - 1) * 100:+.1f} %"),
        ("us per all_reduce (world 1), recorder off", f"{median(c_off):.1f}  ({runs(c_off)})"),
        ("us per all_reduce (world 1), recorder on", f"{median(c_on):.1f}  ({runs(c_on)})"),
        ("  recorder cost per collective", f"{median(c_on) - median(c_off):+.1f} us"),
    ])


if __name__ == "__main__":
    main()
