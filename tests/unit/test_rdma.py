"""RDMA truth (issue 46, item 3): recorded sysfs layouts from public reports
(``data/rdma/cases.json``, each with its source) expanded into real directory trees, read by the
node side's ``read_rdma`` and judged by doctor's ``check_rdma``; and the values run sets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ptcluster.cluster.model import ClusterSpec, MasterSpec, NodeSpec
from ptcluster.doctor.node_report import NodeReport
from ptcluster.doctor.rdma_checks import check_rdma
from ptcluster.node.facts.rdma import configured, link_local, rdma_env, read_rdma, recommend

CASES = json.loads((Path(__file__).parent / "data" / "rdma" / "cases.json").read_text())["cases"]
ZERO = ":".join(["0000"] * 8)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def expand(root: Path, hcas: dict[str, Any]) -> Path:
    """One node's /sys/class/infiniband, as the kernel lays it out (absent when no HCA)."""
    for hca, dev in hcas.items():
        for net in dev["net"]:
            (root / hca / "device" / "net" / net).mkdir(parents=True)
        for port, p in dev["ports"].items():
            pdir = root / hca / "ports" / port
            for name, key in (("state", "state"), ("phys_state", "phys"), ("rate", "rate"),
                              ("link_layer", "ll")):
                write(pdir / name, p[key])
            for index in p.get("unset", []):  # all zeros; its type reads EINVAL: no file
                write(pdir / "gids" / str(index), ZERO)
            for index, gid, kind, ndev in p["gids"]:
                write(pdir / "gids" / str(index), gid)
                if kind is not None:
                    write(pdir / "gid_attrs" / "types" / str(index), kind)
                if ndev is not None:
                    write(pdir / "gid_attrs" / "ndevs" / str(index), ndev)
            write(pdir / "gids" / "127", ZERO)  # the rest of the table: unset
    return root


def judge(case: dict[str, Any], tmp: Path) -> tuple[dict[str, Any], list[Any]]:
    facts = {host: {"rdma": read_rdma(str(expand(tmp / host, hcas)))}
             for host, hcas in case["nodes"].items()}
    spec = ClusterSpec(nodes=tuple(NodeSpec(host=h, python="p", workdir="/w") for h in facts),
                       master=MasterSpec(addr=next(iter(facts))),
                       env=tuple(case.get("env", {}).items()))
    probes = {h: NodeReport(host=h, facts=f) for h, f in facts.items()}
    return facts, check_rdma(spec, probes)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_recorded_layouts(case: dict[str, Any], tmp_path: Path) -> None:
    assert case["source"]  # every layout names where it comes from
    facts, findings = judge(case, tmp_path)
    for host, want in case["expect"].items():
        mine = [f for f in findings if f.host == host]
        assert [f.status for f in mine] == ([] if want["status"] == "none"
                                            else [want["status"]]), mine
        said = recommend(facts[host]["rdma"])
        for key in ("hca", "gid_index"):
            if key in want:
                assert said[key] == want[key], (key, said)
        if "says" in want:
            assert want["says"] in mine[0].detail, mine[0].detail
        for f in mine:  # a warning or failure always says how to fix it
            assert f.status == "ok" or f.fix


def test_there_are_at_least_twelve_recorded_cases() -> None:
    assert len(CASES) >= 12
    assert len({c["name"] for c in CASES}) == len(CASES)


def test_the_reader_keeps_what_the_kernel_says(tmp_path: Path) -> None:
    case = next(c for c in CASES if c["name"] == "k8s-macvlan-pod-gid7")
    devices = read_rdma(str(expand(tmp_path, case["nodes"]["a"])))
    assert [d["name"] for d in devices] == ["mlx5_0", "mlx5_1"]
    port = devices[0]["ports"][0]
    assert (port["port"], port["state"], port["phys_state"], port["link_layer"]) == \
        (1, "ACTIVE", "LinkUp", "Ethernet")
    assert port["rate"] == "200 Gb/sec (4X HDR)"
    assert [g["index"] for g in port["gids"]] == [4, 5, 6, 7]  # unset entries left out
    assert port["gids"][3] == {"index": 7, "gid": "0000:0000:0000:0000:0000:ffff:0a98:000c",
                               "type": "RoCE v2", "ndev": "net1"}
    assert devices[0]["netdevs"] == ["net1"]
    assert read_rdma(str(tmp_path / "absent")) == []


def test_gid_classes_follow_ncclS_own() -> None:
    assert not configured(ZERO)
    assert not configured("fe80:0000:0000:0000:0000:0000:0000:0000")
    assert configured("fe80:0000:0000:0000:0ac0:ebff:feda:1cfb")
    assert link_local("fe80:0000:0000:0000:0ac0:ebff:feda:1cfb")
    assert not link_local("0000:0000:0000:0000:0000:ffff:c800:d106")
    assert not link_local("fd93:0000:0000:0001:0000:0000:0000:0011")
    assert not configured("not a gid")


def test_the_env_run_sets_from_the_facts(tmp_path: Path) -> None:
    roce = next(c for c in CASES if c["name"] == "roce-gid3-two-nodes")
    assert rdma_env(read_rdma(str(expand(tmp_path / "r", roce["nodes"]["a"])))) == \
        {"NCCL_IB_HCA": "=mlx5_bond_0:1", "NCCL_IB_GID_INDEX": "3"}
    ib = next(c for c in CASES if c["name"] == "infiniband-edr")
    assert rdma_env(read_rdma(str(expand(tmp_path / "i", ib["nodes"]["a"])))) == \
        {"NCCL_IB_HCA": "=mlx5_0:1"}  # InfiniBand: no GID index to give
    down = next(c for c in CASES if c["name"] == "hcas-but-no-active-port")
    assert rdma_env(read_rdma(str(expand(tmp_path / "d", down["nodes"]["a"])))) == {}
    assert rdma_env([]) == {}
