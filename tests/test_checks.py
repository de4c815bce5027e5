"""Doctor checks as pure functions, on facts recorded from a real 3-node testbed probe
(tests/data/testbed_facts.json, hosts renamed node0..2 on 10.9.0.0/24), each case mutating
them into one classic failure."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ptcluster.doctor.checks import run_checks
from ptcluster.doctor.collect import NodeProbe
from ptcluster.spec import parse_cluster_text

RECORDED = json.loads((Path(__file__).parent / "data" / "testbed_facts.json").read_text())
CLUSTER = "nodes: [{host: node0, slots: 2}, {host: node1}, {host: node2}]\n"


def probes_from(recorded: dict[str, Any]) -> dict[str, NodeProbe]:
    return {h: NodeProbe(host=h, facts=r["facts"], connects=r["connects"], ssh_s=r["ssh_s"],
                         clock_offset=r["clock_offset"]) for h, r in recorded.items()}


def fails(spec_text: str, mutate: Callable[[dict], None]) -> dict[tuple[str, str], str]:
    data = copy.deepcopy(RECORDED)
    mutate(data)
    spec = parse_cluster_text(spec_text, "c.yaml")
    return {(f.check, f.host): f.line() for f in run_checks(spec, probes_from(data))
            if f.status in ("fail", "warn")}


def test_recorded_healthy_cluster_passes() -> None:
    assert fails(CLUSTER, lambda d: None) == {}


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        keys = path.split(".")
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return mutate


def _gpu(driver: str, count: int, cuda: str = "12.4") -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        for h in d:
            d[h]["facts"]["gpus"] = {"count": count, "driver": driver, "names": ["H200"] * count}
            d[h]["facts"]["torch"].update(cuda=cuda, cuda_available=True, device_count=count,
                                          nccl="2.21.5")
    return mutate


def _failed_connect(host: str, label: str) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        for c in d[host]["connects"]:
            if c["label"] == label:
                c["error"] = "Connection timed out"
    return mutate


CASES = [
    # (id, cluster text, mutation, expected (check, host), words in the message)
    ("torch-version", CLUSTER, _set("node2.facts.torch.version", "2.5.1+cpu"),
     ("versions", "node2"), "torch 2.5.1+cpu (others: 2.13.0+cpu)"),
    ("python-version", CLUSTER, _set("node1.facts.python.version", "3.10.12"),
     ("versions", "node1"), "python 3.10.12"),
    ("torch-missing", CLUSTER, _set("node1.facts.torch", {"ok": False, "error": "No module"}),
     ("versions", "node1"), "torch does not import"),
    ("nccl-version", CLUSTER,
     lambda d: (_gpu("550.54.15", 2)(d), d["node2"]["facts"]["torch"].update(nccl="2.18.1")),
     ("versions", "node2"), "nccl 2.18.1 (others: 2.21.5)"),
    ("driver-old", CLUSTER, _gpu("470.82.01", 2), ("gpus", "node0"),
     "too old for torch's CUDA 12.4"),
    ("gpus-fewer-than-slots", CLUSTER, _gpu("550.54.15", 1), ("gpus", "node0"),
     "1 GPU(s) for 2 slots"),
    ("gpus-more-than-slots", CLUSTER, _gpu("550.54.15", 4), ("gpus", "node1"), "4 GPUs, only 1"),
    ("nccl-without-gpu", CLUSTER + "backend: nccl\n", lambda d: None, ("gpus", "node0"),
     "no NVIDIA GPU, but backend: nccl"),
    ("interface-missing", "nodes: [{host: node0, slots: 2}, {host: node1, interface: eth9}, "
     "{host: node2}]\n", lambda d: None, ("interface", "node1"),
     "interface eth9 not found (has: lo, veth0)"),
    ("interface-down", CLUSTER, lambda d: d["node2"]["facts"]["interfaces"][1].update(up=False),
     ("interface", "node2"), "veth0 is down"),
    ("interface-no-ipv4", CLUSTER, lambda d: d["node1"]["facts"]["interfaces"][1].update(ipv4=[]),
     ("interface", "node1"), "has no IPv4"),
    ("wrong-route", CLUSTER, _set("node1.facts.peers.node2.route_dev", "docker0"),
     ("interface", "node1"), "node2 via docker0, not veth0"),
    ("other-subnet", CLUSTER,
     lambda d: d["node2"]["facts"]["interfaces"][1].update(ipv4=["192.168.5.2/24"]),
     ("interface", "node2"), "not in node0's subnet"),
    ("hostname-loopback", CLUSTER, _set("node1.facts.hostname_addrs", ["127.0.1.1"]),
     ("hostname", "node1"), "resolves to 127.0.1.1 (loopback)"),
    ("master-unresolved", CLUSTER, _set("node2.facts.master.addrs", []),
     ("hostname", "node2"), "cannot resolve the master address node0"),
    ("peer-resolves-elsewhere", CLUSTER, _set("node0.facts.peers.node1.addrs", ["10.9.0.99"]),
     ("hostname", "node0"), "node1 -> 10.9.0.99 (its interface has 10.9.0.12)"),
    ("master-port-taken", CLUSTER,
     _set("node0.facts.listening", {"master": None, "ephemeral": 40000,
                                    "master_error": "Address already in use"}),
     ("master port", "node0"), "already in use"),
    ("master-port-unreachable", CLUSTER, _failed_connect("node2", "master"),
     ("master port", "node2"), "cannot connect to the master node0:29500 (Connection timed out)"),
    ("master-port-ephemeral", "nodes: [{host: node0}, {host: node1}]\nmaster: {port: 40000}\n",
     lambda d: [c.update(port=40000) for h in d for c in d[h]["connects"]
                if c["label"] == "master"], ("master port", "node0"),
     "inside ip_local_port_range"),
    ("ephemeral-blocked", CLUSTER, _failed_connect("node0", "peer:node2"), ("ports", "node0"),
     "cannot reach node2 on 10.9.0.13"),
    ("workdir-missing", CLUSTER, _set("node1.facts.workdir.exists", False),
     ("workdir", "node1"), "does not exist"),
    ("shm-small", CLUSTER, _set("node2.facts.shm", {"free": 1 << 26, "total": 1 << 26}),
     ("resources", "node2"), "/dev/shm only 0.06 GiB"),
    ("disk-low", CLUSTER, _set("node0.facts.disk", {"free": 1 << 30, "total": 1 << 40}),
     ("resources", "node0"), "only 1.0 GiB free"),
    ("clock-skew", CLUSTER, _set("node1.clock_offset", 3.5), ("clock", "node1"), "+3.5 s"),
]


@pytest.mark.parametrize("text,mutate,where,words", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_each_fault_is_named_on_its_node(text, mutate, where, words) -> None:
    found = fails(text, mutate)
    assert where in found, found
    assert words in found[where], found[where]
    assert "Fix:" in found[where]


def test_unreached_node_skips_its_checks_and_fails_ssh() -> None:
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    probes = probes_from(copy.deepcopy(RECORDED))
    probes["node2"] = NodeProbe(host="node2", problem="cannot reach the node over ssh (x)",
                                fix="check it")
    findings = run_checks(spec, probes)
    node2 = {f.check: f.status for f in findings if f.host == "node2"}
    assert node2["ssh"] == "fail" and node2["versions"] == "skip"
    assert not [f for f in findings if f.host != "node2" and f.status == "fail"]
