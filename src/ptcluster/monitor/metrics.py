"""`ptcluster monitor --serve`: the monitor's figures as Prometheus metrics, built anew per scrape.

What is served, and why under these names:

- GPUs under dcgm-exporter's names, units and labels (``DCGM_FI_DEV_GPU_UTIL`` %,
  ``DCGM_FI_DEV_FB_USED``/``_FB_FREE`` MiB, ``DCGM_FI_DEV_POWER_USAGE`` W, ``DCGM_FI_DEV_GPU_TEMP``
  C; labels ``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``: dcgm-exporter's
  etc/default-counters.csv and its labels), so dashboards and alerts made for it work unchanged.
- Nodes as ``ptcluster_node_*`` in base units (ratios, bytes, bytes per second; the Prometheus
  naming guide). ``ptcluster_node_up`` is served for every node of the cluster file, 0 while it
  does not answer (its session ended, or no sample for ``stale`` seconds): a node never
  vanishes from the scrape, so ``ptcluster_node_up == 0`` can page someone.
- Jobs from the leases every node's sampler reads (any user's: ``monitor.jobs``), and from the
  heads of this user on this machine (``control.registry``) the job's own figures: attempt,
  world size, restarts, and per rank the wait share, straggler ratio and collectives completed.

Labels are bounded: ``node`` and ``Hostname`` by the cluster file, ``gpu``/``UUID``/``modelName``
by its GPUs, ``user`` by the machines' users, ``rank`` by the running jobs' world sizes, and
``job_id`` by the jobs that run now. No label holds free-form text (a command line, an error):
the one label that grows over time, ``job_id``, leaves with its job, because every family is
made per scrape (a ``Collector``, not global gauges) and a job that ended is not in it.
``job_id``, not ``job``: Prometheus sets ``job`` to the scrape job's name and would rename ours
to ``exported_job``.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from ptcluster.control import registry as heads
from ptcluster.control.protocol import StragglerAnswer, ask_straggler
from ptcluster.errors import PtclusterError
from ptcluster.monitor.httpd import MetricsServer
from ptcluster.monitor.jobs import Seen, job_rows
from ptcluster.monitor.watch import NodeView
from ptcluster.node.sharing.records import lease_of, rank_count

MIB = 1024 * 1024
GPU_LABELS = ["gpu", "UUID", "device", "modelName", "Hostname"]
"""dcgm-exporter's labels of a GPU series (``pci_bus_id`` in its newer releases is not known
here)."""
DCGM = (  # name, help (dcgm-exporter's words), the sample's field, scale
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "util", 1.0),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "mem_used", 1 / MIB),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "mem_free", 1 / MIB),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w", 1.0),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temp_c", 1.0),
)


def parse_listen(text: str) -> tuple[str, int]:
    """``[ADDR:]PORT`` -> (address, port); the address is localhost unless one is given
    (``0.0.0.0:9400``, ``[::]:9400``). ValueError for anything else."""
    addr, sep, port = text.rpartition(":")
    addr = addr.strip("[]") if sep else "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535 or (sep and not addr):
        raise ValueError(f"{text!r} is not [ADDR:]PORT (e.g. 9400, 0.0.0.0:9400)")
    return addr, int(port)


def fresh(view: NodeView, now: float, stale: float) -> bool:
    """Whether ``view`` is of a node that answers: a sample, no error, none older than
    ``stale`` s (a cut link keeps the ssh session open ~15 s before it ends)."""
    return view.sample is not None and not view.error and view.updated is not None \
        and now - view.updated <= stale


def node_families(views: list[NodeView], now: float, stale: float) -> list[Metric]:
    """Every node's ``up`` and sample age; the figures of those that answer."""
    up = GaugeMetricFamily("ptcluster_node_up", "1 while the node's sampler answers, else 0.",
                           labels=["node"])
    age = GaugeMetricFamily("ptcluster_node_sample_age_seconds",
                            "Seconds since the node's last sample.", labels=["node"])
    info = GaugeMetricFamily("ptcluster_node_info", "The node's own hostname (the Hostname "
                             "label of its GPU series), always 1.", labels=["node", "Hostname"])
    figures = [
        ("cpu_utilization_ratio", "Share of the node's CPU time busy (0-1).",
         lambda s: s["cpu_percent"] / 100),
        ("cpus", "Logical CPUs of the node.", lambda s: s["cpus"]),
        ("memory_used_bytes", "Memory in use (total less available).",
         lambda s: s["mem"]["used"]),
        ("memory_total_bytes", "Memory of the node.", lambda s: s["mem"]["total"]),
        ("network_receive_bytes_per_second", "Bytes received per second, all interfaces "
         "but loopback.", lambda s: s["net"]["rx_bps"]),
        ("network_transmit_bytes_per_second", "Bytes sent per second, all interfaces but "
         "loopback.", lambda s: s["net"]["tx_bps"]),
        ("gpus", "GPUs NVML sees on the node.", lambda s: len(s["gpus"])),
    ]
    fams = [GaugeMetricFamily(f"ptcluster_node_{name}", text, labels=["node"])
            for name, text, _ in figures]
    refused = CounterMetricFamily("ptcluster_scrape_errors", "Samples of the node refused as "
                                  "malformed (its series are left out until a good one).",
                                  labels=["node"])
    for v in views:
        refused.add_metric([v.host], float(v.refused))
        ok = fresh(v, now, stale)
        up.add_metric([v.host], 1.0 if ok else 0.0)
        if v.updated is not None:
            age.add_metric([v.host], max(0.0, now - v.updated))
        if not ok:
            continue
        s = v.sample
        assert s is not None
        info.add_metric([v.host, str(s.get("hostname") or v.host)], 1.0)
        for fam, (_, _, get) in zip(fams, figures, strict=True):
            try:
                fam.add_metric([v.host], float(get(s)))
            except (KeyError, TypeError, ValueError):
                continue  # (a figure the node's sampler did not send)
    return [up, age, info, refused, *fams]


def gpu_families(views: list[NodeView], now: float, stale: float) -> list[Metric]:
    """dcgm-exporter's series of every GPU of the nodes that answer."""
    fams = [GaugeMetricFamily(name, text, labels=GPU_LABELS) for name, text, _, _ in DCGM]
    for v in views:
        if not fresh(v, now, stale):
            continue
        s = v.sample
        assert s is not None
        hostname = str(s.get("hostname") or v.host)
        for g in s.get("gpus") or []:
            i = int(g["index"])
            labels = [str(i), str(g.get("uuid") or ""), f"nvidia{i}", str(g.get("name") or ""),
                      hostname]
            values: dict[str, Any] = {**g, "mem_free": g["mem_total"] - g["mem_used"]}
            for fam, (_, _, key, scale) in zip(fams, DCGM, strict=True):
                if isinstance(values.get(key), (int, float)):
                    fam.add_metric(labels, float(values[key]) * scale)
    return list[Metric](fams)


def lease_families(views: list[NodeView], now: float, stale: float) -> list[Metric]:
    """Every job the leases show (any user's), from the nodes that answer."""
    info = GaugeMetricFamily("ptcluster_job_info", "A job that runs (from its guards' "
                             "leases), always 1.", labels=["job_id", "user", "head", "state"])
    started = GaugeMetricFamily("ptcluster_job_start_time_seconds", "When the job's first "
                                "lease was taken (Unix time).", labels=["job_id"])
    ranks = GaugeMetricFamily("ptcluster_job_node_ranks", "The job's ranks on the node.",
                              labels=["job_id", "node"])
    gpus = GaugeMetricFamily("ptcluster_job_node_gpus", "GPUs the job leased on the node.",
                             labels=["job_id", "node"])
    gpu = GaugeMetricFamily("ptcluster_job_gpu", "1 for each GPU the job leased: join with "
                            "DCGM_FI_* on (Hostname, gpu).", labels=["job_id", "node",
                                                                     "Hostname", "gpu"])
    nodes: Seen = {}
    hostname: dict[str, str] = {}
    for v in views:
        if fresh(v, now, stale):
            s = v.sample
            assert s is not None
            hostname[v.host] = str(s.get("hostname") or v.host)
            nodes[v.host] = (hostname[v.host], str(s.get("user") or ""),
                             list(s.get("leases") or []))
    per_node: dict[tuple[str, str], int] = {}  # (job, hostname) -> its ranks there
    for name, _, records in nodes.values():
        for r in records:
            if r.get("node") == name and lease_of(r)[0] == "job":
                per_node[(str(r.get("job_id")), name)] = rank_count(r)
    for row in job_rows(nodes):
        info.add_metric([row.job_id, row.user, row.head, row.state], 1.0)
        started.add_metric([row.job_id], row.started)
        for node in row.nodes:
            ranks.add_metric([row.job_id, node],
                             float(per_node.get((row.job_id, hostname.get(node, node)), 0)))
        for node, ix in row.gpus.items():
            gpus.add_metric([row.job_id, node], float(len(ix)))
            for i in ix:
                gpu.add_metric([row.job_id, node, hostname.get(node, node), str(i)], 1.0)
    return [info, started, ranks, gpus, gpu]


def head_families(answers: dict[str, StragglerAnswer]) -> list[Metric]:
    """The job's own figures, from its head's answer (``job_id`` -> the head's ``straggler``
    answer: ``control.protocol.Request.STRAGGLER``)."""
    job = ["job_id"]
    rank = ["job_id", "rank", "node"]
    attempt = GaugeMetricFamily("ptcluster_job_attempt", "The running attempt (0: the first).",
                                labels=job)
    world = GaugeMetricFamily("ptcluster_job_world_size", "Ranks of the running attempt.",
                              labels=job)
    nodes = GaugeMetricFamily("ptcluster_job_nodes", "Nodes of the running attempt.",
                              labels=job)
    restarts = CounterMetricFamily("ptcluster_job_restarts", "Times the job was restarted.",
                                   labels=job)
    wait = GaugeMetricFamily("ptcluster_job_rank_wait_share", "Share of the last window the "
                             "rank's main thread waited (mostly in collectives; 0-1).",
                             labels=rank)
    ratio = GaugeMetricFamily("ptcluster_job_rank_straggler_ratio", "The rank's busy share "
                              "over the others' median at the last evaluation (Kx slower).",
                              labels=rank)
    late = GaugeMetricFamily("ptcluster_job_rank_straggler", "1 for the rank(s) named the "
                             "straggler, else 0.", labels=rank)
    done = CounterMetricFamily("ptcluster_job_rank_collectives", "Collectives the rank "
                               "completed this attempt (torch's flight recorder).", labels=rank)
    for job_id, answer in sorted(answers.items()):
        facts = answer.get("job", {})  # (none before the first attempt starts)
        if "attempt" in facts:
            attempt.add_metric([job_id], facts["attempt"])
            restarts.add_metric([job_id], facts["attempt"])
        if "world_size" in facts:
            world.add_metric([job_id], facts["world_size"])
        if "nodes" in facts:
            nodes.add_metric([job_id], facts["nodes"])
        figures = answer.get("straggler")
        if figures is None:
            continue
        ratios = figures["trace"][-1]["ratios"] if figures["trace"] else {}
        current = figures["current"]
        named = set(current["ranks"]) if current is not None else set()
        for r in figures["ranks"]:
            labels = [job_id, str(r["rank"]), r["host"]]
            wait.add_metric(labels, r["wait_share"])
            late.add_metric(labels, 1.0 if r["rank"] in named else 0.0)
            if str(r["rank"]) in ratios:
                ratio.add_metric(labels, ratios[str(r["rank"])])
            done.add_metric(labels, r["collectives_job"])
    return [attempt, world, nodes, restarts, wait, ratio, late, done]


@dataclass
class HeadPoller:
    """Asks this user's heads on this machine for their job's figures every ``interval`` s,
    on its own thread, so a scrape never waits on a head (``latest``: job id -> answer; a
    job whose head is gone leaves it at the next round)."""

    interval: float = 2.0
    timeout: float = 5.0
    latest: dict[str, StragglerAnswer] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> HeadPoller:
        threading.Thread(target=self._run, name="heads", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def poll(self) -> dict[str, StragglerAnswer]:
        """One round: every running head's answer (a head that does not answer is left out)."""
        found: dict[str, StragglerAnswer] = {}
        for entry in heads.running_here():
            try:
                answer = ask_straggler(entry.run_dir, timeout=self.timeout)
            except (PtclusterError, OSError, ValueError):
                continue
            if answer.get("ok"):
                found[entry.job_id] = answer
        return found

    def _run(self) -> None:
        while not self._stop.is_set():
            self.latest = self.poll()
            self._stop.wait(self.interval)


class Exporter(Collector):
    """The monitor's families, made anew at every scrape from ``snapshot()`` (the monitor's
    node views) and ``answers()`` (the heads' figures); ``clock``: the wall clock the views'
    ``updated`` is on."""

    def __init__(self, snapshot: Callable[[], list[NodeView]],
                 answers: Callable[[], dict[str, StragglerAnswer]], stale: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.snapshot, self.answers, self.stale, self.clock = snapshot, answers, stale, clock

    def collect(self) -> Iterator[Metric]:
        views, now = self.snapshot(), self.clock()
        yield from node_families(views, now, self.stale)
        yield from gpu_families(views, now, self.stale)
        yield from lease_families(views, now, self.stale)
        yield from head_families(self.answers())


def registry_of(exporter: Exporter) -> CollectorRegistry:
    """A registry of the exporter alone (not the library's global one: its process and
    platform collectors would be served beside ours)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(exporter)
    return reg


def serve(exporter: Exporter, addr: str, port: int, token: str | None = None,
          tls: ssl.SSLContext | None = None, idle: float = 10.0) -> MetricsServer:
    """``/metrics`` on ``addr:port`` (``monitor.httpd``: one thread, bounded connections, the
    exposition made at most once a second), served until ``shutdown()``."""
    reg = registry_of(exporter)
    return MetricsServer(lambda: generate_latest(reg), CONTENT_TYPE_PLAIN_0_0_4, addr, port,
                         token=token, tls=tls, idle=idle).start()
