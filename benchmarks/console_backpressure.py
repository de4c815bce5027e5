"""A job that floods its output while nobody reads the console: it must go on, finish with
exit 0 and have every line in its log; and what does the head pay per line?

Three runs of the same flood job (one rank printing as fast as it can for --seconds):
- torchrun --standalone, its stdout read continuously (the baseline's line rate);
- ptcluster run, its stdout read continuously;
- ptcluster run, its stdout not read for --pause seconds (a paused pager), then drained.
Printed: exit codes, lines printed vs lines in rank0.log, the job's line rate (each vs the
baseline), lines the console skipped, and the head process's CPU seconds per 100k lines (read
from /proc while it runs). Targets: >= 50k lines/s, exit 0 and every line logged when paused.

    .venv/bin/python benchmarks/console_backpressure.py [--seconds 30] [--pause 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from _common import PTCLUSTER, TORCHRUN, show

FLOOD = """import sys, time
start = time.monotonic()
n = 0
while time.monotonic() - start < float(sys.argv[1]):
    sys.stdout.write("".join(f"line {n + i} of the flood, padded to a realistic length\\n"
                             for i in range(1000)))
    n += 1000
sys.stdout.flush()
print(f"total {n} in {time.monotonic() - start:.2f} s", flush=True)
"""
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime of the head
    except (OSError, IndexError, ValueError):
        return None


def run(argv: list[str], cwd: Path, pause: float) -> dict[str, float | int | str]:
    """Run ``argv``; read its stdout after ``pause`` s, in chunks (it may be gigabytes): keep
    only the lines that matter (the total, the "not shown" notes) and the line count."""
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    cpu = [0.0]

    def sample() -> None:
        while proc.poll() is None:
            value = cpu_seconds(proc.pid)
            if value is not None:
                cpu[0] = value
            time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()
    err: list[bytes] = []
    threading.Thread(target=lambda: err.append(proc.stderr.read()),  # type: ignore[union-attr]
                     daemon=True).start()
    time.sleep(pause)
    assert proc.stdout is not None
    kept: list[str] = []
    lines, rest = 0, b""
    while chunk := proc.stdout.read(1 << 20):
        lines += chunk.count(b"\n")
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        kept += [p.decode(errors="replace") for p in parts
                 if b"total " in p or b"not shown" in p]
    code = proc.wait()
    time.sleep(0.2)
    total_line = [ln for ln in kept if "total " in ln]
    return {"code": code, "cpu": cpu[0], "out": "\n".join(kept), "lines": lines,
            "err": b"".join(err).decode(errors="replace"),
            "total": total_line[-1] if total_line else ""}


def parse_total(text: str) -> tuple[int, float]:
    words = text.split("total ", 1)[1].split()
    return int(words[0]), float(words[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--pause", type=float, default=20.0)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "flood.py").write_text(FLOOD)
        job = ["flood.py", str(args.seconds)]
        base = run(TORCHRUN + ["--standalone", "--nproc-per-node", "1", *job], cwd, 0.0)
        n_base, s_base = parse_total(str(base["total"]))
        rate_base = n_base / s_base
        rows.append(("torchrun (read): exit / lines/s",
                     f"{base['code']} / {rate_base:,.0f}"))
        for label, pause in (("ptcluster (read)", 0.0),
                             (f"ptcluster (paused {args.pause:.0f} s)", args.pause)):
            runs = cwd / f"runs-{pause}"
            r = run(PTCLUSTER + ["run", "--nproc", "1", "--run-dir", str(runs), *job], cwd, pause)
            (run_dir,) = list(runs.iterdir())
            log = (run_dir / "rank0.log").read_text().splitlines()
            n, secs = parse_total(log[-1])
            skipped = sum(int(line.split(" line(s) not shown")[0].rsplit(" ", 1)[-1])
                          for line in str(r["out"]).splitlines() if "line(s) not shown" in line)
            rows += [
                (f"{label}: exit", f"{r['code']}"),
                (f"{label}: lines printed / in rank0.log", f"{n:,} / {len(log) - 1:,}"
                 f"  ({'all' if len(log) - 1 == n else 'MISSING LINES'})"),
                (f"{label}: lines/s (vs torchrun)",
                 f"{n / secs:,.0f}  ({n / secs / rate_base:.2f}x)"),
                (f"{label}: lines the console skipped", f"{skipped:,}"),
                (f"{label}: head CPU s per 100k lines",
                 f"{float(r['cpu']) / n * 100_000:.3f}  ({float(r['cpu']):.1f} s in all)"),
            ]
            if r["code"] != 0:
                rows.append((f"{label}: stderr tail", str(r["err"])[-500:]))
    show(rows)


if __name__ == "__main__":
    main()
