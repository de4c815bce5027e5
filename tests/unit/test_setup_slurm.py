"""``setup --slurm``'s files and steps, from node facts: the ``slurm`` section as this machine's
node program read it (recorded below: Debian 12, slurmd 22.05's ``slurmd -C``), with the GPUs
of a 2+1+1 cluster in the shape ``node.facts.accel.gpus`` reports NVML's answers (no GPU machine was
at hand to record them: the shape is the reader's own)."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

from ptcluster.cluster.model import SlurmSetupSpec
from ptcluster.node.facts.slurm_facts import estimate_hw, parse_slurmd_c
from ptcluster.setup import steps as S
from ptcluster.setup.slurm import gres_conf, slurm_cluster
from ptcluster.setup.slurm_steps import SLURM_DEFS
from ptcluster.setup.torch_choice import TorchChoice

RECORDED = {  # this machine's `slurm` facts (setup_facts.slurm_fact), munge key left out
    "packages": {"munge": True, "slurmd": True, "slurm-client": True, "slurmctld": True},
    "hw": {"CPUs": 2, "Boards": 1, "SocketsPerBoard": 1, "CoresPerSocket": 2,
           "ThreadsPerCore": 1, "RealMemory": 24105},
    "hw_from": "slurmd -C", "cgroup": "v1", "nvml": False, "gpu_files": [],
    "files": {"slurm.conf": None, "gres.conf": None, "cgroup.conf": None},
    "mtimes": {"slurm.conf": None, "gres.conf": None, "cgroup.conf": None},
    "munge_key": {"exists": False},
    "services": {s: {"enabled": True, "active": False, "since": None}
                 for s in ("munge", "slurmd", "slurmctld")},
}
KEY = bytes(range(128))


def node(name: str, gpus: int, nvml: bool, cgroup: str = "v1") -> dict[str, Any]:
    slurm = copy.deepcopy(RECORDED)
    slurm.update(nvml=nvml, cgroup=cgroup,
                 gpu_files=[f"/dev/nvidia{i}" for i in range(gpus)])
    return {"hostname": name, "gpu": {"count": gpus, "driver": "550.54.15" if gpus else None,
                                      "compute_capability": [[9, 0]] * gpus},
            "slurm": slurm}


def cluster_2_1_1() -> dict[str, dict[str, Any]]:
    return {"a": node("gpu-a", 2, nvml=True), "b": node("gpu-b", 1, nvml=True),
            "c": node("gpu-c", 1, nvml=False)}


ADDRS = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}


def test_gres_conf_of_a_2_1_1_cluster() -> None:
    text = gres_conf(cluster_2_1_1())
    assert text is not None
    assert text.splitlines()[1:] == [
        "NodeName=gpu-a AutoDetect=nvml Name=gpu Count=2",
        "NodeName=gpu-b AutoDetect=nvml Name=gpu Count=1",
        "NodeName=gpu-c AutoDetect=off Name=gpu File=/dev/nvidia0",  # no NVML: the device file
    ]
    assert gres_conf({"x": node("cpu", 0, nvml=False)}) is None


def stanzas(conf: str) -> dict[str, dict[str, str]]:
    """slurm.conf's node and partition lines as Slurm reads them: each line's first key=value
    (``NodeName=gpu-a``) to all of its key=values."""
    return {line.split()[0]: dict(kv.split("=", 1) for kv in line.split())
            for line in conf.splitlines() if line.startswith(("NodeName=", "PartitionName="))}


def test_slurm_conf_of_a_2_1_1_cluster() -> None:
    sc = slurm_cluster(SlurmSetupSpec(controller="a"), dict(cluster_2_1_1()), ADDRS, KEY)
    conf = sc.files["slurm.conf"]
    lines = conf.splitlines()
    assert "SlurmctldHost=gpu-a(10.0.0.1)" in lines and "GresTypes=gpu" in lines
    said = stanzas(conf)
    assert said["NodeName=gpu-a"] == {
        "NodeName": "gpu-a", "NodeAddr": "10.0.0.1", "CPUs": "2", "Boards": "1",
        "SocketsPerBoard": "1", "CoresPerSocket": "2", "ThreadsPerCore": "1",
        "RealMemory": "24105", "Gres": "gpu:2", "State": "UNKNOWN"}
    assert said["NodeName=gpu-c"]["Gres"] == "gpu:1"
    assert said["PartitionName=main"] == {"PartitionName": "main", "Nodes": "gpu-a,gpu-b,gpu-c",
                                          "Default": "YES", "MaxTime": "INFINITE", "State": "UP"}
    assert "ProctrackType=proctrack/linuxproc" in lines and "cgroup.conf" not in sc.files
    assert "gres.conf" in sc.files


def test_cgroup_plugins_only_where_every_node_has_cgroup_v2() -> None:
    facts = {h: node(h, 0, False, cgroup="v2") for h in "ab"}
    sc = slurm_cluster(SlurmSetupSpec(controller="a"), dict(facts), ADDRS, KEY)
    assert "ProctrackType=proctrack/cgroup" in sc.files["slurm.conf"]
    assert "CgroupPlugin=cgroup/v2" in sc.files["cgroup.conf"]
    facts["b"]["slurm"]["cgroup"] = "v1"
    sc = slurm_cluster(SlurmSetupSpec(controller="a"), dict(facts), ADDRS, KEY)
    assert "ProctrackType=proctrack/linuxproc" in sc.files["slurm.conf"]
    assert sc.without_cgroup_v2 == ("b",) and "cgroup.conf" not in sc.files


def test_partitions_from_the_cluster_file() -> None:
    spec = SlurmSetupSpec(controller="b", partitions=(("big", ("a",)), ("all", ("a", "b", "c"))))
    conf = slurm_cluster(spec, dict(cluster_2_1_1()), ADDRS, KEY).files["slurm.conf"]
    said = stanzas(conf)
    assert said["PartitionName=big"] == {"PartitionName": "big", "Nodes": "gpu-a",
                                         "Default": "YES", "MaxTime": "INFINITE", "State": "UP"}
    assert said["PartitionName=all"] == {"PartitionName": "all", "Nodes": "gpu-a,gpu-b,gpu-c",
                                         "MaxTime": "INFINITE", "State": "UP"}
    assert "SlurmctldHost=gpu-b(10.0.0.2)" in conf


def cf_for(facts: dict[str, dict[str, Any]]) -> S.ClusterFacts:
    return S.ClusterFacts(
        pubkey="ssh-ed25519 AAAA k", torch=TorchChoice("2.13.0", "cpu", "test"),
        self_version="0.1.0", python="3.11", addrs=ADDRS, hostnames={}, master_addr="10.0.0.1",
        master_port=29500,
        slurm=slurm_cluster(SlurmSetupSpec(controller="a"), dict(facts), ADDRS, KEY))


def plan(host: str, facts: dict[str, Any], cf: S.ClusterFacts) -> dict[str, S.Step]:
    return {d.name: d.plan(host, facts, cf) for d in SLURM_DEFS}


def test_the_munge_key_is_never_in_the_plan() -> None:
    facts = cluster_2_1_1()
    cf = cf_for(facts)
    steps = plan("b", facts["b"], cf)
    assert steps["munge key"].status == S.CHANGE
    shown = json.dumps([s.to_json("b") for s in steps.values()]) + repr(cf) + repr(steps) + \
        "".join(a.display("b") for s in steps.values() for a in s.actions)
    assert base64.b64encode(KEY).decode() not in shown and KEY.hex() not in shown
    assert base64.b64decode(steps["munge key"].actions[0].input or "") == KEY  # its input


def test_a_converged_node_plans_nothing_and_drift_is_a_change() -> None:
    import hashlib

    facts = cluster_2_1_1()
    cf = cf_for(facts)
    assert cf.slurm is not None
    b = facts["b"]["slurm"]
    b["munge_key"] = {"exists": True, "owner": "munge", "mode": "400",
                      "sha256": hashlib.sha256(KEY).hexdigest()}
    b["files"] = {k: cf.slurm.files.get(k) for k in b["files"]}
    b["mtimes"] = {k: 1000 for k in b["files"]}
    b["services"] = {s: {"enabled": True, "active": True, "since": 1000} for s in b["services"]}
    steps = plan("b", facts["b"], cf)
    assert {n: s.status for n, s in steps.items()} == {n: S.OK for n in steps}
    assert steps["slurmctld"].why == "not here: a is the controller"
    b["mtimes"]["slurm.conf"] = 1001  # slurm.conf newer than the running slurmd
    assert plan("b", facts["b"], cf)["slurmd"].status == S.CHANGE
    b["munge_key"]["mode"] = "600"
    assert plan("b", facts["b"], cf)["munge key"].status == S.CHANGE


def test_files_wait_for_every_nodes_facts() -> None:
    facts: dict[str, dict[str, Any] | None] = dict(cluster_2_1_1())
    facts["c"] = None  # did not answer
    sc = slurm_cluster(SlurmSetupSpec(controller="a"), facts, ADDRS, KEY)
    assert sc.files == {}
    cf = cf_for(cluster_2_1_1())
    from dataclasses import replace

    step = plan("a", cluster_2_1_1()["a"], replace(cf, slurm=sc))["slurm.conf"]
    assert step.status == S.BLOCKED and step.problem is not None
    assert step.problem.code == "setup.slurm-files-wait"


def test_parse_slurmd_c_and_estimate_shape() -> None:
    said = ("NodeName=s13n0 CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 "
            "RealMemory=24105\nUpTime=0-11:41:28\n")
    assert parse_slurmd_c(said) == RECORDED["hw"]
    assert set(estimate_hw()) == set(RECORDED["hw"])  # /sys and /proc: no process started


def test_slurm_in_the_cluster_file() -> None:
    import pytest

    from ptcluster.cluster import parse_cluster_text
    from ptcluster.errors import SpecError

    base = "nodes: [a, b, c]\n"
    assert parse_cluster_text(base, "c.yaml").slurm is None
    assert parse_cluster_text(base + "slurm: {}\n", "c.yaml").slurm == \
        SlurmSetupSpec(controller="a")
    spec = parse_cluster_text(base + "slurm: {controller: b, partitions: {gpu: [a, c]}}\n",
                              "c.yaml").slurm
    assert spec == SlurmSetupSpec(controller="b", partitions=(("gpu", ("a", "c")),))
    for bad, said in (("slurm: {controller: z}", "'z' is not a node"),
                      ("slurm: {partitions: {gpu: [a, z]}}", "'z' is not a node"),
                      ("slurm: {partitions: {'a b': [a]}}", "not a Slurm partition name"),
                      ("slurm: {controler: a}", "unknown key")):
        with pytest.raises(SpecError, match=said):
            parse_cluster_text(base + bad + "\n", "c.yaml")


def test_a_node_without_slurm_facts_waits_when_the_files_are_made() -> None:
    """The cluster's files are made (their ``why``: the plugins chosen), but this node's facts
    lack ``slurm``: its files step waits for them; it is not "refused" with the plugins'
    reason as its refusal."""
    from dataclasses import replace

    facts = cluster_2_1_1()
    sc = slurm_cluster(SlurmSetupSpec(controller="a"), dict(facts), ADDRS, KEY)
    assert sc.files and sc.why  # (made, with why its plugins)
    lacking = {k: v for k, v in facts["a"].items() if k != "slurm"}
    (files,) = [d for d in SLURM_DEFS if d.name == "slurm.conf"]
    step = files.plan("a", lacking, replace(cf_for(facts), slurm=sc))
    assert step.status == S.BLOCKED and step.problem is not None
    assert step.problem.code == "setup.slurm-files-wait"
