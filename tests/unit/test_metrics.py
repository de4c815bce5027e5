"""`monitor --serve`'s text exposition, from node views and heads' answers as the monitor holds
them: what each series says, its labels and units, and what is left out (a silent node's
figures, an ended job)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ptcluster.launch.supervise.straggler import StragglerWatch
from ptcluster.monitor.metrics import Exporter, parse_listen, registry_of
from ptcluster.monitor.watch import NodeView
from tests.unit.test_straggler import BAL, SLOW2, drive

NOW = 1_000_000.0
GIB = 1 << 30


def lease(job: str, node: str, resource: str, ranks: list[int] | None = None) -> dict:
    return {"pid": 4242, "uid": 1000,
            "job_id": job, "user": "ann", "head": "h0", "command": "python train.py --lr 3e-4",
            "since": NOW - 60, "node": node, "resource": resource, "ranks": ranks or [0, 0]}


def sample(hostname: str, gpus: int = 0, leases: list[dict] | None = None) -> dict:
    return {"hostname": hostname, "time": NOW, "cpu_percent": 25.0, "cpus": 8,
            "mem": {"used": 3 * GIB, "total": 16 * GIB},
            "net": {"rx_bps": 1000.0, "tx_bps": 2000.0},
            "gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{hostname}-{i}",
                      "util": 40 + i, "mem_used": 512 * 1024 * 1024, "mem_total": 80 * GIB,
                      "power_w": 300.5, "power_limit_w": 700.0, "temp_c": 51}
                     for i in range(gpus)],
            "gpu_error": None, "leases": leases or [], "jobs": {}, "user": "ann"}


def views() -> list[NodeView]:
    job = [lease("j1", "n0", "job-j1", [0, 1]), lease("j1", "n0", "gpu-0"),
           lease("j1", "n0", "gpu-1"), lease("j1", "n0", "port-29500")]
    return [NodeView("a0", sample("n0", 2, job), None, NOW - 1),
            NodeView("a1", sample("n1", 1, [lease("j1", "n1", "job-j1", [2, 2])]), None, NOW - 1),
            NodeView("a2", sample("n2"), "unreachable: Connection timed out", NOW - 30),
            NodeView("a3", sample("n3", 1), None, NOW - 30),  # silent: its last sample is old
            NodeView("a4")]  # never answered


def scrape(node_views: list[NodeView], answers: dict | None = None) -> dict[str, list]:
    """name -> [(labels, value)], as Prometheus would parse the text."""
    exporter = Exporter(lambda: node_views, lambda: answers or {}, stale=8.0,
                        clock=lambda: NOW)
    text = generate_latest(registry_of(exporter)).decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def by(series: list, key: str) -> dict[str, float]:
    return {labels[key]: value for labels, value in series}


def test_every_node_has_up_and_only_answering_nodes_have_figures() -> None:
    got = scrape(views())
    assert by(got["ptcluster_node_up"], "node") == {"a0": 1, "a1": 1, "a2": 0, "a3": 0, "a4": 0}
    for name in ("ptcluster_node_cpu_utilization_ratio", "ptcluster_node_memory_used_bytes",
                 "ptcluster_node_network_receive_bytes_per_second", "ptcluster_node_cpus"):
        assert set(by(got[name], "node")) == {"a0", "a1"}, name
    assert by(got["ptcluster_node_cpu_utilization_ratio"], "node")["a0"] == 0.25
    assert by(got["ptcluster_node_memory_total_bytes"], "node")["a1"] == 16 * GIB
    assert by(got["ptcluster_node_network_transmit_bytes_per_second"], "node")["a0"] == 2000
    assert by(got["ptcluster_node_sample_age_seconds"], "node") == {"a0": 1, "a1": 1, "a2": 30,
                                                                   "a3": 30}
    assert [(lb["node"], lb["Hostname"]) for lb, _ in got["ptcluster_node_info"]] == \
        [("a0", "n0"), ("a1", "n1")]


def test_gpus_under_dcgm_exporter_names_units_and_labels() -> None:
    got = scrape(views())
    util = got["DCGM_FI_DEV_GPU_UTIL"]
    assert [lb for lb, _ in util] == [
        {"gpu": "0", "UUID": "GPU-n0-0", "device": "nvidia0",
         "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "n0"},
        {"gpu": "1", "UUID": "GPU-n0-1", "device": "nvidia1",
         "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "n0"},
        {"gpu": "0", "UUID": "GPU-n1-0", "device": "nvidia0",
         "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "n1"}]  # n3 is silent: none
    assert [v for _, v in util] == [40, 41, 40]
    assert got["DCGM_FI_DEV_FB_USED"][0][1] == 512  # MiB
    assert got["DCGM_FI_DEV_FB_FREE"][0][1] == 80 * 1024 - 512
    assert got["DCGM_FI_DEV_POWER_USAGE"][0][1] == 300.5  # W
    assert got["DCGM_FI_DEV_GPU_TEMP"][0][1] == 51


def test_a_gpu_without_power_or_temperature_has_no_such_series() -> None:
    v = views()[:1]
    assert v[0].sample is not None
    v[0].sample["gpus"][1].update(power_w=None, temp_c=None)
    got = scrape(v)
    assert by(got["DCGM_FI_DEV_POWER_USAGE"], "gpu") == {"0": 300.5}
    assert by(got["DCGM_FI_DEV_GPU_TEMP"], "gpu") == {"0": 51}


def test_jobs_from_the_leases_with_bounded_labels() -> None:
    got = scrape(views())
    assert got["ptcluster_job_info"] == [({"job_id": "j1", "user": "ann", "head": "h0",
                                           "state": "running"}, 1)]
    assert by(got["ptcluster_job_node_ranks"], "node") == {"a0": 2, "a1": 1}
    assert by(got["ptcluster_job_node_gpus"], "node") == {"a0": 2}
    assert [(lb["Hostname"], lb["gpu"]) for lb, _ in got["ptcluster_job_gpu"]] == \
        [("n0", "0"), ("n0", "1")]
    assert got["ptcluster_job_start_time_seconds"] == [({"job_id": "j1"}, NOW - 60)]
    labels = {v for series in got.values() for lb, _ in series for v in lb.values()}
    assert not any("train.py" in v for v in labels)  # no command line in any label


def head_answer(attempt: int = 1) -> dict:
    watch = StragglerWatch()
    drive(watch, [BAL] * 4 + [SLOW2] * 6)
    assert watch.current is not None and watch.current.ranks == (2,)
    return {"ok": True, "straggler": watch.to_json(),
            "job": {"attempt": attempt, "world_size": 3, "nodes": 3}}


def test_the_jobs_own_figures_from_its_head() -> None:
    answer = head_answer()
    got = scrape(views(), {"j1": answer})
    assert got["ptcluster_job_attempt"] == [({"job_id": "j1"}, 1)]
    assert got["ptcluster_job_restarts_total"] == [({"job_id": "j1"}, 1)]
    assert got["ptcluster_job_world_size"] == [({"job_id": "j1"}, 3)]
    assert got["ptcluster_job_nodes"] == [({"job_id": "j1"}, 3)]
    wait = {(lb["rank"], lb["node"]): v for lb, v in got["ptcluster_job_rank_wait_share"]}
    assert wait == {(str(r["rank"]), r["host"]): r["wait_share"]
                    for r in answer["straggler"]["ranks"]}
    assert by(got["ptcluster_job_rank_straggler"], "rank") == {"0": 0, "1": 0, "2": 1}
    ratio = by(got["ptcluster_job_rank_straggler_ratio"], "rank")
    assert ratio == {k: pytest.approx(v) for k, v in
                     answer["straggler"]["trace"][-1]["ratios"].items()}
    assert ratio["2"] > 1.5 > ratio["0"]
    assert by(got["ptcluster_job_rank_collectives_total"], "rank") == {"0": 500, "1": 500,
                                                                       "2": 500}


def test_an_ended_jobs_series_are_gone_at_the_next_scrape() -> None:
    before = scrape(views(), {"j1": head_answer()})
    assert any(lb.get("job_id") == "j1" for series in before.values() for lb, _ in series)
    ended = views()
    for v in ended:
        if v.sample:
            v.sample["leases"] = []
    after = scrape(ended, {})
    assert not any("job_id" in lb for series in after.values() for lb, _ in series)
    assert by(after["ptcluster_node_up"], "node")["a0"] == 1  # the nodes stay


@pytest.mark.parametrize("text, want", [
    ("9400", ("127.0.0.1", 9400)), ("0.0.0.0:9400", ("0.0.0.0", 9400)),
    ("[::]:9400", ("::", 9400)), ("[::1]:0", ("::1", 0))])
def test_listen_address(text: str, want: tuple[str, int]) -> None:
    assert parse_listen(text) == want


@pytest.mark.parametrize("text", ["", "x", ":9400", "host:", "1.2.3.4:99999", "9400:x"])
def test_listen_address_refused(text: str) -> None:
    with pytest.raises(ValueError, match="ADDR"):
        parse_listen(text)
