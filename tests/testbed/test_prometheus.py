"""`ptcluster monitor --serve` scraped by the real Prometheus (Debian's ``prometheus``, started
here on a free localhost port with a data directory of its own and a 1 s scrape interval), the
monitor watching the 3-node namespace testbed; everything checked through Prometheus' HTTP API
(``/api/v1/query``), as a dashboard or an alert would see it: every node's series and labels,
a running job's series (and their absence once it ended), every query of the dashboard in
``monitoring/`` (data where this machine has it, GPU panels parsed), and a node whose link is
cut turning to ``ptcluster_node_up 0`` and back."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.support.head import Head, job_id_when_started

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
JOB = REPO / "tests" / "programs" / "straggler_job.py"
DASHBOARD = REPO / "monitoring" / "grafana-dashboard.json"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prom:
    """The real Prometheus scraping the monitor, asked through its HTTP API."""

    def __init__(self, target: str, tmp: Path) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(  # (the shipped example's scrape job, at a test's pace)
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n  - job_name: ptcluster\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n")
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def api(self, path: str, **params: str) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return dict(json.load(r))
        except urllib.error.HTTPError as exc:  # a bad query: 400 with Prometheus' reason
            return dict(json.load(exc))

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = self.api("query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        return list(answer["data"]["result"])

    def until(self, expr: str, ok: Callable[[list[dict[str, Any]]], bool],
              timeout: float = 60.0) -> tuple[list[dict[str, Any]], float]:
        """The first answer to ``expr`` that is ``ok``, and the seconds it took."""
        t0 = time.monotonic()
        got: list[dict[str, Any]] = []
        while time.monotonic() - t0 < timeout:
            try:
                got = self.query(expr)
            except OSError:  # (not listening yet)
                got = []
            if ok(got):
                return got, time.monotonic() - t0
            time.sleep(0.5)
        raise AssertionError(f"{expr}: not as expected after {timeout:.0f} s: {got}")

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def values(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


@pytest.fixture(scope="module")
def served(testbed, tmp_path_factory) -> Iterator[tuple[Prom, Head, Path]]:
    """``monitor --serve`` over the testbed's 3 nodes (1 s samples), and Prometheus on it."""
    if not os.path.exists(PROMETHEUS):
        pytest.skip("prometheus is not installed (scripts/test.sh installs it)")
    tmp = tmp_path_factory.mktemp("prom")
    cluster = Path(testbed.write_cluster(tmp, [1, 1, 1]))
    port = free_port()
    monitor = Head(["monitor", "--cluster", str(cluster), "--interval", "1",
                    "--serve", f"127.0.0.1:{port}"], cwd=tmp,
                   env={"PTCLUSTER_TRUST_CLUSTER_FILE": "1"})  # (module-wide: set here)
    prom = None
    try:
        monitor.wait_for("serving Prometheus metrics", timeout=60)
        prom = Prom(f"127.0.0.1:{port}", tmp)
        yield prom, monitor, cluster
    finally:
        if prom is not None:
            prom.close()
        monitor.signal(signal.SIGINT)
        try:
            assert monitor.wait(timeout=30) == 0, monitor.output()
        finally:
            monitor.kill()


def test_every_node_with_its_labels(served, testbed) -> None:
    prom, _, _ = served
    names = {n.name for n in testbed.nodes}
    up, took = prom.until("ptcluster_node_up",
                          lambda r: values(r, "node") == dict.fromkeys(names, 1.0))
    print(f"all 3 nodes up in Prometheus {took:.1f} s after it started")
    assert {r["metric"]["job"] for r in up} == {"ptcluster"}  # the scrape job's, not ours
    info = prom.query("ptcluster_node_info")
    assert {(r["metric"]["node"], r["metric"]["Hostname"]) for r in info} == \
        {(n, n) for n in names}  # the hostname each node's sampler read on the node itself
    for name in ("cpu_utilization_ratio", "cpus", "memory_used_bytes", "memory_total_bytes",
                 "network_receive_bytes_per_second", "network_transmit_bytes_per_second",
                 "gpus", "sample_age_seconds"):
        got = values(prom.query(f"ptcluster_node_{name}"), "node")
        assert set(got) == names, (name, got)
    assert all(0 <= v <= 1 for v in values(prom.query("ptcluster_node_cpu_utilization_ratio"),
                                           "node").values())
    assert all(v > 2**20 for v in values(prom.query("ptcluster_node_memory_total_bytes"),
                                         "node").values())  # bytes, not kB or GB
    assert prom.query("DCGM_FI_DEV_GPU_UTIL") == []  # no GPU here: no series, not zeros
    assert values(prom.query('up{job="ptcluster"}'), "job") == {"ptcluster": 1.0}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel, Grafana's variables as "All" would set them."""
    dash = json.loads(DASHBOARD.read_text())
    subst = {"$node": ".*", "$job_id": ".*", "$__rate_interval": "1m"}
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in subst.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, (panel["title"], expr)
            out.append((panel["title"], expr))
    return out


def test_a_jobs_series_while_it_runs_the_dashboard_and_none_after(served, testbed,
                                                                  tmp_path, no_leftovers) -> None:
    prom, _, _ = served
    cluster = testbed.write_cluster(tmp_path, [1, 1, 1])
    runs = tmp_path / "runs"
    job = Head(["run", "--cluster", cluster, "--run-dir", str(runs), str(JOB), "--seconds",
                "300"], cwd=tmp_path)
    try:
        job_id = job_id_when_started(runs)
        no_leftovers.append(job_id)
        sel = f'{{job_id="{job_id}"}}'
        nodes = {n.name for n in testbed.nodes}
        ranks, took = prom.until(f"ptcluster_job_node_ranks{sel}",
                                 lambda r: values(r, "node") == dict.fromkeys(nodes, 1.0), 120)
        print(f"job {job_id}: its lease series in Prometheus {took:.1f} s after its start")
        (info,) = prom.query(f"ptcluster_job_info{sel}")
        assert info["metric"]["user"] == "root" and info["metric"]["state"] == "running"
        assert set(info["metric"]) == {"__name__", "job_id", "user", "head", "state",
                                       "instance", "job"}  # no command line
        # the head's own figures: the straggler watch needs 3 timing reports of every rank
        waits, took = prom.until(f"ptcluster_job_rank_wait_share{sel}",
                                 lambda r: len(r) == 3, 120)
        print(f"its head's per-rank figures {took:.1f} s later")
        assert {(r["metric"]["rank"], r["metric"]["node"]) for r in waits} == \
            {(str(n.index), n.name) for n in testbed.nodes}
        assert values(prom.query(f"ptcluster_job_world_size{sel}"), "job_id") == {job_id: 3}
        assert values(prom.query(f"ptcluster_job_attempt{sel}"), "job_id") == {job_id: 0}
        assert values(prom.query(f"ptcluster_job_restarts_total{sel}"), "job_id") == {job_id: 0}
        assert values(prom.query(f"ptcluster_job_nodes{sel}"), "job_id") == {job_id: 3}
        done, _ = prom.until(f"ptcluster_job_rank_collectives_total{sel}",
                             lambda r: len(r) == 3 and all(float(x["value"][1]) > 0 for x in r))
        ratio, _ = prom.until(f"ptcluster_job_rank_straggler_ratio{sel}", lambda r: len(r) == 3)
        for title, expr in [("wait share", f"ptcluster_job_rank_wait_share{sel}"),
                            ("straggler ratio", f"ptcluster_job_rank_straggler_ratio{sel}"),
                            ("collectives", f"ptcluster_job_rank_collectives_total{sel}"),
                            ("collectives/s", f"rate(ptcluster_job_rank_collectives_total{sel}"
                                              "[1m])"),
                            ("ranks", f"ptcluster_job_node_ranks{sel}")]:
            shown = {r["metric"].get("rank") or r["metric"].get("node"): r["value"][1]
                     for r in prom.query(expr)}
            print(f"  {title}: {shown}")
        for title, expr in dashboard_queries():
            if "DCGM_" in expr:  # no GPU here: it must parse and run, and says nothing
                assert prom.query(expr) == [], (title, expr)
            else:
                assert prom.until(expr, bool, 30), (title, expr)
    finally:
        job.signal(signal.SIGINT)
        try:
            job.wait(timeout=60)
        finally:
            job.kill()
    t0 = time.monotonic()
    gone = ("ptcluster_job_info", "ptcluster_job_node_ranks", "ptcluster_job_world_size",
            "ptcluster_job_rank_wait_share", "ptcluster_job_rank_collectives_total")
    for name in gone:
        prom.until(f"{name}{sel}", lambda r: r == [], 30)
    print(f"its series gone from Prometheus {time.monotonic() - t0:.1f} s after its head ended")
    assert len(prom.query("ptcluster_node_up == 1")) == 3  # the nodes stay


def test_a_cut_link_is_node_up_0_and_back_to_1(served, testbed) -> None:
    prom, monitor, _ = served
    victim, names = testbed.nodes[1], {n.name for n in testbed.nodes}
    prom.until("ptcluster_node_up == 1", lambda r: len(r) == 3)
    before = sessions(monitor, victim.name)
    assert len(before) == 1, before
    testbed.cut_link(victim)
    try:
        up, took = prom.until("ptcluster_node_up", lambda r: values(r, "node") == {
            **dict.fromkeys(names, 1.0), victim.name: 0.0}, 30)
        print(f"{victim.name}'s link cut: ptcluster_node_up 0 after {took:.1f} s")
        assert took < 15  # 3 samples of 1 s missed, +2 s, and a scrape or two
        # a down node keeps its up series, and has no figures that would look current
        assert victim.name not in values(prom.query("ptcluster_node_cpus"), "node")
        # ssh gives up on the session (transport.SSH_DEFAULTS: 12 s); the monitor tries anew
        # every 5 s (each try fails after ssh's 5 s ConnectTimeout while the link is down)
        deadline = time.monotonic() + 30
        while sessions(monitor, victim.name) == before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sessions(monitor, victim.name) != before, "the cut session did not end"
    finally:
        testbed.restore_link(victim)
    _, took = prom.until("ptcluster_node_up", lambda r: values(r, "node") == dict.fromkeys(
        names, 1.0), 60)
    print(f"link restored: ptcluster_node_up 1 after {took:.1f} s")
    assert monitor.proc.poll() is None, monitor.output()
    after = sessions(monitor, victim.name)
    assert len(after) == 1 and after != before  # a new session, the monitor's own reopen


def sessions(monitor: Head, host: str) -> set[int]:
    """The pids of the monitor's ssh sessions to ``host``."""
    import psutil

    out = set()
    for child in psutil.Process(monitor.proc.pid).children():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if argv[:1] == ["ssh"] and host in argv:
            out.add(child.pid)
    return out
