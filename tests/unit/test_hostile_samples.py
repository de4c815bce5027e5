"""A hostile node's samples (M4): each malformed sample is that node's error, counted in
``ptcluster_scrape_errors_total{node}``; the scrape and the live table go on for every node,
that one's series left out, and every label stays bounded."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from ptcluster.cli.monitor_cmd import table
from ptcluster.monitor.metrics import Exporter, registry_of
from ptcluster.monitor.watch import NodeView, receive
from ptcluster.remote.replies import LABEL, MAX_LEASES, BadReply, sample_reply
from tests.unit.test_metrics import NOW, lease, sample

GOOD = {**sample("n0", 2, [lease("j1", "n0", "job-j1", [0, 1]), lease("j1", "n0", "gpu-0")]),
        "pools": []}


def bent(path: str, value: Any) -> dict[str, Any]:
    """GOOD with the value at ``path`` (dots; a number is a list index) replaced."""
    out = copy.deepcopy(GOOD)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    where: Any = out
    for p in parents:
        where = where[p]
    where[last] = value
    return out


MALFORMED = [
    bent("gpus.0.index", "0"), bent("gpus.0.mem_total", None), bent("gpus.1.mem_used", "x"),
    bent("cpu_percent", "50"), bent("cpu_percent", float("nan")), bent("mem", []),
    bent("net.rx_bps", True), bent("hostname", "x" * (LABEL + 1)), bent("gpus.0.name", "a\nb"),
    bent("gpus.0.uuid", "U" * 1_000_000), bent("gpus", [GOOD["gpus"][0]] * 65),
    bent("leases", [GOOD["leases"][0]] * (MAX_LEASES + 1)),
    bent("jobs", {"j" * 300: {"user": "a", "ranks": 1, "gpus": []}}),
    bent("gpus.0.power_limit_w", None), bent("user", 7), ["not", "a", "table"],
]


@pytest.mark.parametrize("bad", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_sample_drops_that_nodes_series_and_is_counted(bad: object) -> None:
    views = [NodeView("a0"), NodeView("a1")]
    receive(views[0], json.dumps(GOOD), NOW - 1)
    receive(views[1], json.dumps(GOOD).replace('"n0"', '"n1"'), NOW - 1)
    receive(views[1], json.dumps(bad), NOW - 1)  # (its last good sample is not shown either)
    exporter = Exporter(lambda: views, dict, stale=8.0, clock=lambda: NOW)
    text = generate_latest(registry_of(exporter)).decode()
    got: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            got.setdefault(s.name, {})[s.labels.get("node") or s.labels.get("Hostname")] = s.value
    assert got["ptcluster_node_up"] == {"a0": 1.0, "a1": 0.0}
    assert got["ptcluster_scrape_errors_total"] == {"a0": 0.0, "a1": 1.0}
    assert set(got["DCGM_FI_DEV_GPU_UTIL"]) == {"n0"}
    assert "a1" not in got["ptcluster_node_cpus"]
    assert views[1].error and "sample" in views[1].error
    Console(file=open("/dev/null", "w"), width=200).print(table(views))  # (does not raise)


def test_every_label_of_a_sample_is_bounded() -> None:
    assert sample_reply(GOOD) == GOOD
    with pytest.raises(BadReply, match="at most 256"):
        sample_reply(bent("hostname", "h" * 257))


@pytest.mark.parametrize("path, value", [
    ("leases.0.command", "c" * 257), ("leases.0.user", "u" * 300), ("leases.0.ranks", [0, 2**40]),
    ("leases.0.since", 1e300), ("leases.0.x\nkey", 1)])
def test_a_bad_lease_record_is_dropped_and_the_sample_stands(path: str, value: object) -> None:
    """Lease records are other users' words (any user writes one): a bad one costs only
    itself, never the node's sample; and a node believes none that the head would drop."""
    from ptcluster.node.sharing.records import well_formed

    bad = bent(path, value)
    assert not well_formed({"pid": 10, "uid": 0, **bad["leases"][0]})
    assert sample_reply(bad)["leases"] == GOOD["leases"][1:]


def test_what_the_node_adds_is_dropped_and_what_it_leaves_out_is_refused() -> None:
    assert "extra" not in sample_reply({**GOOD, "extra": "x" * 10_000_000})
    with pytest.raises(BadReply, match="gpus is None"):
        sample_reply({k: v for k, v in GOOD.items() if k != "gpus"})


def test_a_node_believes_no_record_with_a_text_longer_than_a_label() -> None:
    from ptcluster.node.sharing.records import well_formed
    record = {"pid": 10, "uid": 1000, "since": NOW, "job_id": "j1", "command": "c" * LABEL}
    assert well_formed(record)
    assert not well_formed({**record, "command": "c" * (LABEL + 1)})
    assert not well_formed({**record, "other": "o" * (LABEL + 1)})


@pytest.mark.parametrize("record", [
    {"resource": "gpu-0", "node": "n0", "unknown": True},  # a planted lock entry: shown as held
    {"resource": "gpu-0", "node": "n0", "unknown": True, "user": "x"},
    {"resource": "gpu-0", "node": 5, "unknown": True},
    {k: v for k, v in GOOD["leases"][0].items() if k != "pid"},  # (the head took this before)
    {**GOOD["leases"][0], "since": -1},
    {**GOOD["leases"][0], "job_id": "../x"},
    GOOD["leases"][1]])
def test_the_head_takes_exactly_the_lease_records_a_node_believes(record: dict) -> None:
    """One rule for both sides (``records.sampled``): what the sampler may send and what the
    head keeps of a sample can no longer drift apart."""
    from ptcluster.node.sharing.records import sampled

    kept = sample_reply({**GOOD, "leases": [record]})["leases"]
    assert kept == ([record] if sampled(record) else [])
    assert sampled(record) is (record in (GOOD["leases"][1],
                                          {"resource": "gpu-0", "node": "n0", "unknown": True}))
