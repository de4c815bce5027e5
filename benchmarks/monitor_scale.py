"""`ptcluster monitor` at scale: the real ``Monitor`` and the CLI's own watch loop with N nodes,
each node the real sampler program (packed and started as on a node) over the local transport.

The samplers run in the monitor's session under ``SCHED_IDLE``: they get a CPU only when the
monitor does not want one (real nodes are other machines; here 1024 of them share 2 cores).
Per (N, mode), one fresh process:
- first: seconds until every node's first sample (``Monitor.wait_first``);
- cpu: the monitor process's CPU (user+sys) over ``--seconds`` of watching, % of one core:
  ``table`` is the live table as a terminal gets it (``cli.monitor_cmd.watch``: rich's Live,
  160 columns, into /dev/null), ``json`` the ``--json`` line per interval (into /dev/null);
- rss MB, threads, fds (per node): the monitor's peaks; samples: how many arrived.

    .venv/bin/python benchmarks/monitor_scale.py [--nodes 64,256,1024] [--modes table,json]
        [--seconds 20] [--interval 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import ROOT, core_share, cpu, last_json, proc_status


def watch_once(nodes: int, mode: str, seconds: float, interval: float) -> dict[str, Any]:
    """One monitor of ``nodes`` local nodes in this process; its figures."""
    from dataclasses import dataclass

    from rich.console import Console

    from ptcluster.cli import raise_open_files_limit
    from ptcluster.cli.monitor_cmd import watch
    from ptcluster.cluster import parse_cluster_text
    from ptcluster.monitor.watch import Monitor
    from ptcluster.remote.transport import LocalTransport

    @dataclass
    class IdleLocal(LocalTransport):
        def spawn(self, node_argv: list[str]) -> subprocess.Popen[bytes]:
            return subprocess.Popen(self.argv(node_argv), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    process_group=0, preexec_fn=idle)

    raise_open_files_limit()
    text = "nodes:\n" + "".join(f"  - {{host: m{i}, python: {sys.executable}}}\n"
                                for i in range(nodes))
    spec = parse_cluster_text(text, "<monitor nodes>")
    samples: list[tuple[float, float, int, int, int]] = []
    got = [0]
    frames = Monitor._frames

    def counted(self: Monitor, host: str, lines: list[str]) -> None:
        got[0] += sum(1 for line in lines if line.startswith("sample "))
        frames(self, host, lines)

    Monitor._frames = counted  # type: ignore[method-assign]
    t0 = time.monotonic()
    mon = Monitor(spec, {n.host: IdleLocal(host=n.host) for n in spec.nodes}, interval=interval)
    try:
        mon.wait_first(600.0)
        first = time.monotonic() - t0
        errors = sum(1 for v in mon.snapshot() if v.error)
        done, stop = threading.Event(), threading.Event()

        def sample() -> None:
            while not done.wait(0.5):
                samples.append((time.monotonic(), cpu(), *proc_status()))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        got[0] = 0
        threading.Timer(seconds, stop.set).start()
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            console = Console(file=sink, force_terminal=True, width=160, height=50)
            watch(mon, Path(tempfile.mkdtemp(prefix="monitor-scale-")), interval,
                  mode == "json", stop, console=console)
        done.set()
        sampler.join()
    finally:
        mon.close()
    cpu_pct = core_share(samples, seconds)
    return {"nodes": nodes, "mode": mode, "first": round(first, 2), "errors": errors,
            "cpu": round(cpu_pct, 1), "rss": round(max(s[2] for s in samples) / 1024, 1),
            "threads": max(s[3] for s in samples), "fds": max(s[4] for s in samples),
            "samples": got[0], "expected": round(nodes * seconds / interval)}


def idle() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def one(nodes: int, mode: str, seconds: float, interval: float) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--one", str(nodes), mode, str(seconds), str(interval)]
    return last_json(argv, ROOT / "benchmarks", nodes=nodes, mode=mode)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="64,256,1024")
    ap.add_argument("--modes", default="table,json")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        n, mode, seconds, interval = args.one
        result = watch_once(int(n), mode, float(seconds), float(interval))
        print(json.dumps(result))
        return
    print(f"# monitor --interval {args.interval:g}, {args.seconds:.0f} s of watching, the "
          "real sampler on every node (SCHED_IDLE)")
    print("| nodes | mode | first sample of every node s | monitor CPU % | RSS MB | threads "
          "| fds (per node) | samples (expected) | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in (int(x) for x in args.nodes.split(",")):
        for mode in args.modes.split(","):
            r = one(n, mode, args.seconds, args.interval)
            if "cpu" not in r:
                print(f"| {n} | {mode} | **failed**: {r.get('cause')} | | | | | | |",
                      flush=True)
                continue
            print(f"| {n} | {mode} | {r['first']} | {r['cpu']} | {r['rss']} | {r['threads']} "
                  f"| {r['fds']} ({r['fds'] / n:.1f}) | {r['samples']} ({r['expected']}) "
                  f"| {r['errors']} |", flush=True)


if __name__ == "__main__":
    main()
