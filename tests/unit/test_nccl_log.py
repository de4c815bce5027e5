"""What NCCL chose (issue 46, item 4): the parser on recorded NCCL init logs from public issues
(``data/nccl/*.log``, each naming its source on its first line), and the run-side wiring: the
environment the guard gives ranks on a GPU node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ptcluster.node.facts.nccl_log import DEBUG_SUBSYS, merge, parse, read_dir
from ptcluster.node.wire import NcclChoice

DATA = Path(__file__).parent / "data" / "nccl"
EXPECT: dict[str, dict[str, Any]] = {
    "roce-two-hcas.log": {"transport": "IB", "network": "IB", "hca": "mlx5_10:1,mlx5_11:1",
                          "link": "RoCE"},
    "infiniband-nccl-2.4.log": {"transport": "IB", "network": None, "hca": "mlx5_0:1",
                                "link": "IB", "sockets": "ib0"},
    "ec2-no-ib-device.log": {"transport": "Socket", "hca": None, "sockets": "ens3",
                             "no_ib_device": True},
    "ib-disabled-socket-lo.log": {"transport": "Socket", "network": "Socket", "sockets": "lo"},
    "ib-sharp-plugin.log": {"transport": "IB", "network": "IBext",
                            "hca": "mlx5_0:1,mlx5_1:1,mlx5_4:1,mlx5_5:1", "link": "IB"},
    "roce-plugin-ibext-v8.log": {"transport": "IB", "network": "IBext_v8", "link": "RoCE",
                                 "hca": ",".join(f"mlx5_{i}:1" for i in range(8))},
    "socket-forced-dgx.log": {"transport": "Socket", "hca": None, "sockets": "enp225s0f1"},
    "roce-macvlan-pod.log": {"transport": "IB", "hca": "mlx5_4:1", "link": "RoCE",
                             "gid_index": None},
    "h200-nccl-2.28-sockets.log": {"transport": "Socket", "network": "Socket", "hca": None,
                                   "sockets": "eth0", "no_ib_device": True},
}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_recorded_logs(name: str) -> None:
    lines = (DATA / name).read_text().splitlines()
    # every log names where it comes from: a public report, or this project's own GPU run
    assert lines[0].startswith(("# source: https://", "# source: recorded by this project"))
    said = parse(lines)
    for key, value in EXPECT[name].items():
        assert said[key] == value, (key, said)


def test_every_recorded_log_is_checked() -> None:
    assert sorted(p.name for p in DATA.glob("*.log")) == sorted(EXPECT)
    assert len(EXPECT) >= 6


def test_the_gid_index_nccl_took_from_its_environment() -> None:
    # NCCL logs every variable it takes in this shape (the ENV subsystem, hence DEBUG_SUBSYS),
    # as the recorded NCCL_IB_DISABLE line of infiniband-nccl-2.4.log
    said = parse(["h:1:2 [0] NCCL INFO NCCL_IB_GID_INDEX set by environment to 3.",
                  "h:1:2 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [RO]; OOB eth0:1.2.3.4<0>",
                  "h:1:2 [0] NCCL INFO Using network IB"])
    assert (said["transport"], said["hca"], said["gid_index"]) == ("IB", "mlx5_0:1", 3)
    assert "ENV" in DEBUG_SUBSYS.split(",") and "INIT" in DEBUG_SUBSYS and "NET" in DEBUG_SUBSYS
    assert parse(["no NCCL here"])["transport"] is None


def test_a_node_from_its_ranks_files(tmp_path: Path) -> None:
    for i, name in enumerate(("roce-two-hcas.log", "roce-two-hcas.log")):
        (tmp_path / f"nccl.host.{100 + i}.log").write_text((DATA / name).read_text())
    (tmp_path / "other.txt").write_text("NCCL INFO Using network Socket\n")  # not NCCL's file
    node = read_dir(str(tmp_path))
    assert node == {"transport": "IB", "hca": "mlx5_10:1,mlx5_11:1", "link": "RoCE",
                    "sockets": None, "gid_index": None, "ranks": 2}
    assert read_dir(str(tmp_path / "absent")) is None
    mixed = merge([parse((DATA / "roce-two-hcas.log").read_text().splitlines()),
                   parse((DATA / "ec2-no-ib-device.log").read_text().splitlines())])
    assert mixed is not None and mixed["transport"] == "IB+Socket"
    assert merge([parse([])]) is None


def _env(facts: dict[str, Any], env: dict[str, str] | None = None,
         tmpdir: str = "/tmp/job") -> dict[str, str]:
    from ptcluster.node.guard.spawn import rank_env

    cfg: Any = {"env": env or {}, "env_defaults": {}}
    return rank_env(cfg, facts, tmpdir, "/tmp/job/g.sock")


def test_the_guard_has_nccl_write_its_choice_on_a_gpu_node(monkeypatch: Any) -> None:
    for var in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_IB_HCA",
                "NCCL_IB_GID_INDEX"):
        monkeypatch.delenv(var, raising=False)
    gpu = {"gpus": {"indices": [0, 1], "visible": "0,1"},
           "rdma": {"NCCL_IB_HCA": "=mlx5_0:1", "NCCL_IB_GID_INDEX": "3"}}
    env = _env(gpu)
    assert (env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]) == ("INFO", "INIT,NET,ENV")
    assert env["NCCL_DEBUG_FILE"] == "/tmp/job/nccl.%h.%p.log"  # the job's dir, per rank
    assert (env["NCCL_IB_HCA"], env["NCCL_IB_GID_INDEX"]) == ("=mlx5_0:1", "3")
    # the user's env: wins, for the HCA, the GID index and NCCL's debug output alike
    mine = _env(gpu, {"NCCL_DEBUG": "WARN", "NCCL_IB_GID_INDEX": "5"})
    assert mine["NCCL_DEBUG"] == "WARN" and "NCCL_DEBUG_FILE" not in mine
    assert (mine["NCCL_IB_HCA"], mine["NCCL_IB_GID_INDEX"]) == ("=mlx5_0:1", "5")
    family = _env(gpu, {"NCCL_IB_ADDR_FAMILY": "AF_INET6"})  # NCCL picks the GID itself
    assert "NCCL_IB_GID_INDEX" not in family and family["NCCL_IB_HCA"] == "=mlx5_0:1"
    cpu = _env({"rdma": {}})  # no GPU: no NCCL, nothing set
    assert not {"NCCL_DEBUG", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX"} & set(cpu)


def test_the_guard_reports_what_its_ranks_files_say(tmp_path: Path) -> None:
    from ptcluster.launch.supervise.events import GuardExit, decode
    from ptcluster.node.guard.spawn import nccl_said
    from ptcluster.node.wire import Kind, encode

    env = {"NCCL_DEBUG_FILE": str(tmp_path / "nccl.%h.%p.log"), "NCCL_IB_GID_INDEX": "3"}
    assert nccl_said(str(tmp_path), env) == {}  # NCCL wrote nothing (gloo, or no rank ran)
    (tmp_path / "nccl.h.7.log").write_text((DATA / "roce-macvlan-pod.log").read_text())
    said = nccl_said(str(tmp_path), env)
    assert said["nccl"]["transport"] == "IB" and said["nccl"]["gid_index"] == 3  # as given
    assert nccl_said(str(tmp_path), {}) == {}  # not our file: the user's NCCL_DEBUG_FILE
    frame = encode(Kind.EXIT, {"code": 0, "reason": "job ended", **said}).decode()
    event = decode("n1", frame.strip())  # as the head reads the guard's frame
    assert isinstance(event, GuardExit) and event.nccl is not None
    assert event.nccl["hca"] == "mlx5_4:1"


def test_a_node_with_hcas_on_sockets_is_a_warning_naming_it() -> None:
    from ptcluster.launch.nccl_report import nccl_lines
    from ptcluster.launch.result import NodeOutcome

    ib = NodeOutcome(host="a", node_rank=0, nccl={"transport": "IB", "link": "RoCE",
                                                  "hca": "mlx5_0:1", "gid_index": 3})
    sock = NodeOutcome(host="b", node_rank=1, nccl={
        "transport": "Socket", "sockets": "eth0", "hcas": ["mlx5_0"],
        "cause": "no HCA port is ACTIVE (mlx5_0:1 DOWN)"})
    plain = NodeOutcome(host="c", node_rank=2, nccl={"transport": "Socket", "sockets": "ens3"})
    lines, warnings = nccl_lines([ib, sock, plain, NodeOutcome(host="d", node_rank=3)])
    assert lines == ["a: NCCL over IB (RoCE) mlx5_0:1, GID index 3",
                     "b: NCCL over TCP sockets (eth0)", "c: NCCL over TCP sockets (ens3)"]
    assert [(w.who, w.code) for w in warnings] == [("b", "run.nccl-on-sockets")]
    assert warnings[0].fields == {"hcas": "mlx5_0", "cause": sock.nccl["cause"]}


def test_what_a_guard_said_of_nccl_reaches_the_node_and_summary() -> None:
    from ptcluster.cluster import parse_cluster_text
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.plan import Target, plan_launch
    from ptcluster.launch.supervise import events as ev
    from ptcluster.launch.supervise.supervisor import Supervisor

    spec = parse_cluster_text("nodes:\n  - {host: a, slots: 1}\n", "c.yaml")
    sup = Supervisor(plan_launch(spec, Target(script="t.py"), port=29500, job_id="J"),
                     RunOptions(), now=0.0, wall_offset=0.0)
    said = ev.nccl_chosen({"transport": "IB", "hca": "mlx5_0:1", "gid_index": 3, "x": "y",
                           "cause": "z" * 1000})
    assert said is not None and "x" not in said and len(said["cause"] or "") == 300  # bounded
    assert set(said) == set(NcclChoice.__annotations__)  # every key the guard declares
    assert (said["gid_index"], said["ranks"], said["hcas"]) == (3, None, None)
    sup.on_event(ev.GuardExit("a", 0, "job ended", "", said), 4.0)
    (node,) = sup.nodes
    assert node.nccl == said


def test_hcas_listed_but_not_used_are_not_reported_as_used() -> None:
    # NCCL_NET=Socket on a node whose NET/IB found devices (lines as in roce-two-hcas.log)
    said = parse(["h:1:2 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [RO]; OOB eth0:1.2.3.4<0>",
                  "h:1:2 [0] NCCL INFO NET/Socket : Using [0]eth0:1.2.3.4<0>",
                  "h:1:2 [0] NCCL INFO Using network Socket"])
    assert (said["transport"], said["hca"], said["link"], said["sockets"]) == \
        ("Socket", None, None, "eth0")
