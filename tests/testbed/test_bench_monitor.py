"""bench and monitor across the namespace testbed."""

from __future__ import annotations

import json
import sys

import pytest

from ptcluster.bench.formulas import bus_factor
from tests.support.head import Head, run_head
from tests.support.sweeps import footer

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
PY = sys.executable


def test_bench_4_ranks_with_pair_matrix(testbed, tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(testbed.cluster_yaml([2, 1, 1], python=PY, workdir=str(tmp_path),
                                         port=29580))
    code, head = run_head(["bench", "--cluster", str(path), "--op", "all", "-b", "1K", "-e",
                           "256K", "-f", "16", "-n", "3", "-w", "1", "--pairs", "--pair-size",
                           "1M", "--json-out", "out.json"], cwd=tmp_path, timeout=240)
    assert code == 0, head.output()
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["world_size"] == 4 and data["out_of_bounds"] == 0
    assert {r["op"] for r in data["rows"]} == {"all_reduce", "all_gather", "reduce_scatter",
                                                "broadcast", "sendrecv"}
    for r in data["rows"]:
        algbw = r["size"] / (r["time_us"] / 1e6) / 1e9
        assert r["busbw"] == pytest.approx(algbw * bus_factor(r["op"], 4), rel=1e-6)
    names = [n.name for n in testbed.nodes]
    pairs = {(p["a"], p["b"]) for p in data["pairs"]}
    assert pairs == {(names[0], names[1]), (names[0], names[2]), (names[1], names[2])}
    assert all(p["gbps"] > 0 for p in data["pairs"])
    text = "\n".join(head.lines)
    assert footer(text)["Out of bounds values"] == "0 OK", text
    # the pair matrix: a row per node, its bandwidth to each node as the JSON says
    hosts = list(dict.fromkeys([p["a"] for p in data["pairs"]] + [p["b"] for p in data["pairs"]]))
    rows = {cells[1]: cells[2:] for cells in (line.split() for line in head.lines)
            if cells[:1] == ["#"] and len(cells) == len(hosts) + 2 and cells[1] in hosts}
    gbps = {frozenset((p["a"], p["b"])): f"{p['gbps']:.3f}" for p in data["pairs"]}
    assert rows == {a: [gbps.get(frozenset((a, b)), "-") for b in hosts] for a in hosts}, text
    low = min(data["pairs"], key=lambda p: p["gbps"])  # named, with the median, in both
    slowest = data["slowest_pair"]
    assert (slowest["a"], slowest["b"], slowest["gbps"]) == (low["a"], low["b"], low["gbps"])
    assert f"# slowest pair: {low['a']} <-> {low['b']} {low['gbps']:.3f} GB/s" in text


def test_monitor_once_json_every_node_even_with_one_unreachable(testbed, tmp_path) -> None:
    n = testbed.nodes
    path = tmp_path / "c.yaml"
    path.write_text(
        f"nodes:\n  - {{host: {n[0].name}}}\n  - {{host: {testbed.unused_addr}}}\n"
        f"  - {{host: {n[1].name}}}\n  - {{host: {n[2].name}}}\n"
        f"ssh: {{config_file: {testbed.ssh_config}}}\npython: {PY}\nworkdir: {tmp_path}\n")
    code, head = run_head(["monitor", "--cluster", str(path), "--once", "--json"],
                          cwd=tmp_path, timeout=60)
    assert code == 0, head.output()
    data = json.loads("\n".join(head.lines))
    by_host = {v["host"]: v for v in data["nodes"]}
    assert list(by_host) == [n[0].name, testbed.unused_addr, n[1].name, n[2].name]
    assert not by_host[testbed.unused_addr]["ok"]
    assert "unreachable" in by_host[testbed.unused_addr]["error"]
    for node in n:
        v = by_host[node.name]
        assert v["ok"], v
        s = v["sample"]
        assert s["hostname"] == node.name  # sampled on the node itself
        assert 0 <= s["cpu_percent"] <= 100 and s["mem"]["total"] > 0
        assert s["gpus"] == [] and s["net"]["rx_bps"] >= 0


def test_monitor_shows_a_running_job(testbed, tmp_path, no_leftovers) -> None:
    (tmp_path / "sleep.py").write_text(
        "import time, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "print('ready', flush=True)\ntime.sleep(60)\n")
    path = tmp_path / "c.yaml"
    path.write_text(testbed.cluster_yaml([1, 1], python=PY, workdir=str(tmp_path), port=29581))
    job = Head(["run", "--cluster", str(path), "--run-dir", "runs", "sleep.py"], cwd=tmp_path)
    try:
        job.wait_for("ready", count=2)
        job_id = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir()).name
        no_leftovers.append(job_id)  # checked even when an assertion below fails
        code, head = run_head(["monitor", "--cluster", str(path), "--once", "--json"],
                              cwd=tmp_path, timeout=60)
        assert code == 0, head.output()
        data = json.loads("\n".join(head.lines))
        for v in data["nodes"]:
            seen = v["sample"]["jobs"].get(job_id) or {}  # from the leases: anyone's job
            assert seen.get("user") == "root" and seen.get("ranks", 0) >= 1, v["sample"]
    finally:
        job.signal(2)
        job.wait(timeout=30)
        job.kill()
