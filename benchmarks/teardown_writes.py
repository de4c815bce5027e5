"""Where the time of a stop to 1024 nodes goes: one ``head_scale`` head with one node failing,
every ``os.write`` of the channels' I/O thread timed, and the interpreter's GC passes.

Prints the stop writes' span, the time spent inside ``os.write`` against the gaps between
writes, their percentiles and the slowest, and every GC pass over 50 ms. ``--idle-fakes`` starts
the fake nodes under ``chrt --idle`` (they get a CPU only when the head does not want one).

    .venv/bin/python benchmarks/teardown_writes.py [--nodes 1024] [--idle-fakes]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import threading
import time
from typing import Any

import head_scale

import ptcluster.remote.channel as channel
from ptcluster.remote.transport import Transport


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--idle-fakes", action="store_true")
    args = ap.parse_args()
    real_write = os.write
    writes: list[tuple[float, float, int]] = []

    def timed(fd: int, data: Any) -> int:
        t0 = time.monotonic()
        try:
            return real_write(fd, data)
        finally:
            if threading.current_thread().name == "channels":
                writes.append((t0, time.monotonic(), len(data)))

    channel.os.write = timed  # type: ignore[assignment]  # (the os module: every caller's)
    if args.idle_fakes:
        def spawn(self: Transport, node_argv: list[str]) -> subprocess.Popen[bytes]:
            return subprocess.Popen(["chrt", "--idle", "0", *self.argv(node_argv)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)

        Transport.spawn = spawn  # type: ignore[method-assign]
    passes: list[list[float]] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append([time.monotonic(), 0.0])
        elif passes:
            passes[-1][1] = time.monotonic()

    gc.callbacks.append(on_gc)
    result = head_scale.head(args.nodes, 0.0, 12.0, True)
    os.write = real_write
    print(json.dumps({k: result[k] for k in ("ready", "head_told", "head_wrote",
                                             "wrote_spread")}))
    stops = sorted(w for w in writes if w[2] > 20)[-args.nodes:]  # (hb is 3 bytes)
    if not stops:
        return
    inside = sorted(end - start for start, end, _ in stops)
    gaps = sorted(stops[i + 1][0] - stops[i][1] for i in range(len(stops) - 1))

    def ms(values: list[float], q: float) -> float:
        return round(values[int(q * (len(values) - 1))] * 1000, 3)

    print(f"stop writes: {len(stops)} over {stops[-1][1] - stops[0][0]:.2f} s; inside os.write "
          f"{sum(inside):.2f} s, between writes {sum(gaps):.2f} s")
    print("inside os.write ms p50/p90/p99/max", [ms(inside, q) for q in (0.5, 0.9, 0.99, 1)])
    print("between writes ms p50/p90/p99/max", [ms(gaps, q) for q in (0.5, 0.9, 0.99, 1)])
    print("GC passes over 50 ms (s):", [round(e - s, 3) for s, e in passes if e - s > 0.05])


if __name__ == "__main__":
    main()
