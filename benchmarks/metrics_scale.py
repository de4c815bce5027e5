"""`ptcluster monitor --serve` at scale: what one Prometheus scrape costs the monitor, and the
monitor's CPU share serving one every 15 s, beside the live table's, with N nodes.

The nodes are fake samplers (``--fake``, the default: this file run as a node program over the
local transport, through the real ``Monitor``, its channels and hub) that send, every interval,
a sample shaped like a real 8-GPU node's: the sampler's own fields, 8 GPUs (NVML's figures,
H100 names and UUIDs), and the leases of one job that spans every node (a job lease, 8 GPU
leases; the port lease on the first node): so the text carries what a busy GPU cluster's does.
``--real`` uses the real sampler instead (no GPU here: node series only). The nodes run under
``SCHED_IDLE`` (they get a CPU only when the monitor does not want one; real nodes are other
machines).

Per N, fresh processes:
- scrape: the CPU of one scrape (``thread_time`` of the thread that renders the text, the
  collector included: prometheus_client's own ``generate_latest``), median and max of
  ``--scrapes``, and the text's size;
- cpu: the monitor process's CPU (user+sys) over ``--seconds``, % of one core: ``table`` the
  live table as a terminal gets it (``cli.monitor_cmd.watch``, 160 columns, into /dev/null),
  ``serve`` what ``--serve`` runs (``cli.monitor_cmd.serve_metrics``: the HTTP endpoint, the
  heads' poller, the session reopener), scraped over HTTP every ``--every`` s by another process
  that asks for gzip, as Prometheus does (the compression is the monitor's CPU too).

    .venv/bin/python benchmarks/metrics_scale.py [--nodes 1024] [--seconds 60] [--every 15]
        [--interval 2] [--real]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import ROOT, core_share, cpu, last_json, proc_status

GPUS = 8
JOB = "20261203-010000-b3nch0"


def fake_sampler(host: str, index: int) -> None:
    """A node program (stdin: the packed source line, then the config line) that sends the
    sample of an 8-GPU node running rank ``8*index..8*index+7`` of one job."""
    sys.path.insert(0, str(ROOT / "src"))
    from ptcluster.node.wire import Kind, encode, hello

    sys.stdin.buffer.readline()
    cfg = json.loads(sys.stdin.readline())
    interval = float(cfg.get("interval", 2.0))
    since = time.time() - 3600
    record = {"job_id": JOB, "user": "ann", "head": "n0", "command": "python train.py",
              "since": since, "node": host, "pid": 1000 + index, "uid": 1000}
    leases = [{**record, "resource": f"job-{JOB}", "ranks": [GPUS * index,
                                                              GPUS * index + GPUS - 1]}]
    leases += [{**record, "resource": f"gpu-{i}"} for i in range(GPUS)]
    if index == 0:
        leases.append({**record, "resource": "port-29500"})
    out = sys.stdout.buffer
    out.write(hello("sampler"))
    out.flush()
    n = 0
    while True:
        n += 1
        gpus = [{"index": i, "name": "NVIDIA H100 80GB HBM3",
                 "uuid": f"GPU-{index:08x}-{i:04x}-4c1f-9d2e-5b7a3c0e{i:04x}",
                 "util": (n * 7 + i) % 100, "mem_used": 60_000_000_000 + i, "mem_total":
                 85_520_809_984, "power_w": 512.5 + i, "power_limit_w": 700.0,
                 "temp_c": 55 + i % 5} for i in range(GPUS)]
        sample = {"hostname": host, "time": time.time(), "cpu_percent": 37.5, "cpus": 192,
                  "mem": {"used": 400_000_000_000, "total": 2_000_000_000_000},
                  "net": {"rx_bps": 1.2e9, "tx_bps": 1.1e9}, "gpus": gpus, "gpu_error": None,
                  "leases": leases, "jobs": {JOB: {"user": "ann", "ranks": GPUS,
                                                   "gpus": list(range(GPUS))}}, "user": "ann"}
        try:
            out.write(encode(Kind.SAMPLE, sample))
            out.flush()
        except OSError:
            return
        time.sleep(interval)


def idle() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def monitor_of(nodes: int, interval: float, real: bool) -> Any:
    from dataclasses import dataclass

    from ptcluster.cli import raise_open_files_limit
    from ptcluster.cluster import parse_cluster_text
    from ptcluster.monitor.watch import Monitor
    from ptcluster.remote.transport import LocalTransport

    @dataclass
    class IdleLocal(LocalTransport):
        index: int = 0

        def spawn(self, node_argv: list[str]) -> subprocess.Popen[bytes]:
            argv = self.argv(node_argv) if real else \
                [sys.executable, __file__, "--node", self.host, str(self.index)]
            return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, process_group=0, preexec_fn=idle)

    raise_open_files_limit()
    text = "nodes:\n" + "".join(f"  - {{host: n{i}, python: {sys.executable}}}\n"
                                for i in range(nodes))
    spec = parse_cluster_text(text, "<metrics nodes>")
    return Monitor(spec, {n.host: IdleLocal(host=n.host, index=i)
                          for i, n in enumerate(spec.nodes)}, interval=interval)


def scrape_cost(nodes: int, interval: float, real: bool, scrapes: int) -> dict[str, Any]:
    """CPU and text of ``scrapes`` scrapes, every node answering."""
    from prometheus_client import generate_latest

    from ptcluster.monitor.metrics import Exporter, registry_of

    mon = monitor_of(nodes, interval, real)
    try:
        mon.wait_first(600.0)
        time.sleep(interval)  # (every node's second sample: the figures of a steady state)
        registry = registry_of(Exporter(mon.snapshot, dict, stale=3 * interval + 2.0))
        costs, size, series = [], 0, 0
        for _ in range(scrapes):
            t0 = time.thread_time()
            text = generate_latest(registry)
            costs.append(time.thread_time() - t0)
            size = len(text)
            series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
            time.sleep(0.5)
        up = sum(1 for v in mon.snapshot() if v.sample and not v.error)
    finally:
        mon.close()
    return {"nodes": nodes, "up": up, "cpu_ms_median": round(1000 * statistics.median(costs), 1),
            "cpu_ms_max": round(1000 * max(costs), 1), "bytes": size, "series": series}


def share(nodes: int, mode: str, seconds: float, every: float, interval: float,
          real: bool) -> dict[str, Any]:
    """The monitor's CPU over ``seconds`` of ``mode`` (table, serve)."""
    from rich.console import Console

    from ptcluster.cli.monitor_cmd import serve_metrics, watch

    mon = monitor_of(nodes, interval, real)
    samples: list[tuple[float, float, int]] = []
    scrapes: list[list[float]] = []
    try:
        mon.wait_first(600.0)
        done, stop = threading.Event(), threading.Event()

        def sample() -> None:
            while not done.wait(0.5):
                samples.append((time.monotonic(), cpu(), proc_status()[0]))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        threading.Timer(seconds, stop.set).start()
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            if mode == "table":
                console = Console(file=sink, force_terminal=True, width=160, height=50)
                watch(mon, Path(tempfile.mkdtemp(prefix="metrics-scale-")), interval, False,
                      stop, console=console)
            else:
                port = free_port()
                scraper = subprocess.Popen([sys.executable, __file__, "--scrape", str(port),
                                            str(every), str(seconds)], stdout=subprocess.PIPE,
                                           text=True)
                serve_metrics(mon, ("127.0.0.1", port), interval, stop)
                out, _ = scraper.communicate(timeout=120)
                scrapes = [json.loads(line) for line in out.splitlines() if line]
        done.set()
        sampler.join()
    finally:
        mon.close()
    pct = core_share(samples, seconds)
    return {"nodes": nodes, "mode": mode, "cpu": round(pct, 1),
            "rss": round(max(s[2] for s in samples) / 1024, 1),
            "scrapes": len(scrapes), "scrape_s_max": round(max((s[0] for s in scrapes),
                                                               default=0.0), 3),
            "bytes": max((s[1] for s in scrapes), default=0),
            "gzip_bytes": max((s[2] for s in scrapes), default=0)}


def scraper(port: int, every: float, seconds: float) -> None:
    """Prometheus' part: GET /metrics every ``every`` s (the first after 1 s); per scrape a
    JSON line ``[seconds, bytes]``."""
    deadline = time.monotonic() + seconds
    time.sleep(1.0)
    while time.monotonic() < deadline - 1.0:
        t0 = time.monotonic()
        ask = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept-Encoding": "gzip"})  # (as Prometheus)
        with urllib.request.urlopen(ask, timeout=30) as r:
            wire = r.read()
        text = gzip.decompress(wire) if wire[:2] == b"\x1f\x8b" else wire
        print(json.dumps([round(time.monotonic() - t0, 3), len(text), len(wire)]), flush=True)
        time.sleep(max(0.0, every - (time.monotonic() - t0)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    if sys.argv[1:2] == ["--node"]:
        fake_sampler(sys.argv[2], int(sys.argv[3]))
        return
    if sys.argv[1:2] == ["--scrape"]:
        scraper(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="1024")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--every", type=float, default=15.0)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--scrapes", type=int, default=10)
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        n, mode = int(args.one[0]), args.one[1]
        result = scrape_cost(n, args.interval, args.real, args.scrapes) if mode == "scrape" \
            else share(n, mode, args.seconds, args.every, args.interval, args.real)
        print(json.dumps(result))
        return
    kind = "real samplers (no GPU)" if args.real else f"fake samplers, {GPUS} GPUs and 1 job each"
    print(f"# monitor --interval {args.interval:g}, {kind}, SCHED_IDLE; CPU over "
          f"{args.seconds:.0f} s, a scrape every {args.every:g} s")
    common = [sys.executable, __file__, "--interval", str(args.interval), "--seconds",
              str(args.seconds), "--every", str(args.every), "--scrapes", str(args.scrapes)]
    common += ["--real"] if args.real else []
    for n in (int(x) for x in args.nodes.split(",")):
        got = {mode: last_json([*common, "--one", str(n), mode], ROOT / "benchmarks",
                               nodes=n, mode=mode) for mode in ("scrape", "table", "serve")}
        print(json.dumps(got))
        s, t, v = got["scrape"], got["table"], got["serve"]
        if not all("cause" not in x for x in (s, t, v)):
            print(f"| {n} | failed: {[x.get('cause') for x in (s, t, v) if 'cause' in x]} |")
            continue
        print(f"nodes {n} ({s['up']} answering): one scrape {s['cpu_ms_median']} ms CPU "
              f"(max {s['cpu_ms_max']}; target <= 100), {s['bytes'] / 1e6:.2f} MB of text "
              f"(target <= 5), {s['series']} series")
        print(f"  monitor CPU: live table {t['cpu']} % of a core; --serve scraped every "
              f"{args.every:g} s {v['cpu']} % (target <= 20; {v['scrapes']} scrapes, the "
              f"slowest {v['scrape_s_max']} s, {v['bytes'] / 1e6:.2f} MB of text, "
              f"{v['gzip_bytes'] / 1e6:.3f} MB gzipped on the wire); serve/table "
              f"{v['cpu'] / t['cpu']:.2f}; RSS {t['rss']} / {v['rss']} MB", flush=True)


if __name__ == "__main__":
    main()
