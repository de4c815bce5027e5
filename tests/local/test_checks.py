"""Doctor checks as pure functions, on facts recorded from a real 3-node testbed probe
(tests/local/data/testbed_facts.json, hosts renamed node0..2 on 10.9.0.0/24), each case mutating
them into one classic failure; then the probe's parsers on recorded strings (nvidia-smi,
torch/version.py, the NVIDIA driver's version files, library file names)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ptcluster.cluster import parse_cluster_text
from ptcluster.doctor.checks import Finding, run_checks
from ptcluster.doctor.node_report import NodeReport, ProblemKind
from ptcluster.errors import Problem
from ptcluster.node import FACTS as PROBE_PROGRAM
from ptcluster.node import IMPORTER
from ptcluster.node.facts import accel
from ptcluster.remote.bootstrap import module_source, shipped

RECORDED = json.loads((Path(__file__).parent / "data" / "testbed_facts.json").read_text())
CLUSTER = "nodes: [{host: node0, slots: 2}, {host: node1}, {host: node2}]\n"


def probes_from(recorded: dict[str, Any]) -> dict[str, NodeReport]:
    return {h: NodeReport(host=h, facts=r["facts"], connects=r["connects"], ssh_s=r["ssh_s"],
                         clock_offset=r["clock_offset"]) for h, r in recorded.items()}


def fails(spec_text: str, mutate: Callable[[dict], None]) -> dict[tuple[str, str], Finding]:
    data = copy.deepcopy(RECORDED)
    mutate(data)
    spec = parse_cluster_text(spec_text, "c.yaml")
    return {(f.check, f.host): f for f in run_checks(spec, probes_from(data))
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


def _gpu(driver: str, count: int, cuda: str = "12.4",
         cuda_driver: str | None = None) -> Callable[[dict], None]:
    """Every node gets ``count`` H200s and a CUDA build of torch (as the probe reports them)."""
    def mutate(d: dict) -> None:
        for h in d:
            d[h]["facts"]["gpus"] = {
                "count": count, "names": ["NVIDIA H200"] * count,
                "memory_mib": [143771] * count, "compute_capability": ["9.0"] * count,
                "driver": driver, "cuda_driver": cuda_driver, "source": "nvml", "error": None}
            d[h]["facts"]["torch"].update(version=f"2.13.0+cu{cuda.replace('.', '')}",
                                          cuda=cuda, nccl="2.21.5", cudnn="9.13.0.50")
    return mutate


def _both(*mutations: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        for m in mutations:
            m(d)
    return mutate


def _failed_connect(host: str, label: str) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        for c in d[host]["connects"]:
            if c["label"] == label:
                c["error"] = "Connection timed out"
    return mutate


CASES = [
    # (id, cluster text, mutation, expected (check, host), its code, some of its fields)
    ("torch-version", CLUSTER, _set("node2.facts.torch.version", "2.5.1+cpu"),
     ("versions", "node2"), "doctor.versions-differ",
     {"diffs": "torch 2.5.1+cpu (others: 2.13.0+cpu)"}),
    ("python-version", CLUSTER, _set("node1.facts.python.version", "3.10.12"),
     ("versions", "node1"), "doctor.versions-differ",
     {"diffs": "python 3.10.12 (others: 3.11.7)"}),
    ("torch-missing", CLUSTER,
     _set("node1.facts.torch", {"ok": False, "version": None, "unknown": {},
                                "error": "torch is not installed for /usr/bin/python3"}),
     ("versions", "node1"), "doctor.torch-missing",
     {"error": "torch is not installed for /usr/bin/python3"}),
    ("torch-version-unknown", CLUSTER,
     lambda d: d["node1"]["facts"]["torch"].update(
         version=None, unknown={"torch": "no package metadata, and no __version__"}),
     ("versions", "node1"), "doctor.versions-unknown",
     {"told": "torch (no package metadata, and no __version__)"}),
    ("nccl-version", CLUSTER,
     _both(_gpu("550.54.15", 2), _set("node2.facts.torch.nccl", "2.18.1")),
     ("versions", "node2"), "doctor.versions-differ",
     {"diffs": "nccl 2.18.1 (others: 2.21.5)"}),
    ("nccl-unknown", CLUSTER,
     _both(_gpu("550.54.15", 2), lambda d: d["node2"]["facts"]["torch"].update(
         nccl=None, unknown={"nccl": "no nvidia-nccl-* package and no libnccl.so.X.Y file"})),
     ("versions", "node2"), "doctor.versions-unknown",
     {"told": "nccl (no nvidia-nccl-* package and no libnccl.so.X.Y file)"}),
    ("driver-old", CLUSTER, _gpu("470.82.01", 2), ("gpus", "node0"), "doctor.driver-too-old",
     {"driver": "470.82.01", "cuda": "12.4", "need": "525.60.13"}),
    ("driver-old-cuda13", CLUSTER, _gpu("575.57.08", 2, cuda="13.0"), ("gpus", "node0"),
     "doctor.driver-too-old",
     {"driver": "575.57.08", "cuda": "13.0", "need": "580.65.06"}),
    ("driver-behind-unlisted-cuda", CLUSTER, _gpu("580.82.07", 2, "14.0", cuda_driver="13.0"),
     ("gpus", "node1"), "doctor.driver-cuda-older",
     {"cuda": "14.0", "cuda_driver": "13.0"}),
    ("cpu-torch-on-gpus", CLUSTER,
     _both(_gpu("580.82.07", 2, cuda="13.0"),
           lambda d: d["node1"]["facts"]["torch"].update(version="2.13.0+cpu", cuda=None,
                                                         nccl=None)),
     ("gpus", "node1"), "doctor.torch-cpu-build",
     {"count": "2", "version": "2.13.0+cpu"}),
    ("nvml-broken", CLUSTER,
     _set("node2.facts.gpus.error", "nvmlInit: Driver/library version mismatch"),
     ("gpus", "node2"), "doctor.no-gpu-found",
     {"error": "nvmlInit: Driver/library version mismatch"}),
    ("gpus-fewer-than-slots", CLUSTER, _gpu("550.54.15", 1), ("gpus", "node0"),
     "doctor.gpus-fewer-than-slots",
     {"count": "1", "slots": "2"}),
    ("gpus-more-than-slots", CLUSTER, _gpu("550.54.15", 4), ("gpus", "node1"), "doctor.gpus-unused",
     {"count": "4", "slots": "1"}),
    ("nccl-without-gpu", CLUSTER + "backend: nccl\n", lambda d: None, ("gpus", "node0"),
     "doctor.nccl-without-gpu",
     {"why": ""}),
    ("interface-missing", "nodes: [{host: node0, slots: 2}, {host: node1, interface: eth9}, "
     "{host: node2}]\n", lambda d: None, ("interface", "node1"), "doctor.interface-missing",
     {"interface": "eth9", "names": "lo, veth0", "choices": "veth0"}),
    ("interfaces-unlisted", CLUSTER,
     lambda d: d["node1"]["facts"].update(
         interfaces=[], interfaces_error="`ip -j addr show` failed: ip: not installed"),
     ("interface", "node1"), "doctor.interfaces-unlisted",
     {"error": "`ip -j addr show` failed: ip: not installed"}),
    ("interface-down", CLUSTER, lambda d: d["node2"]["facts"]["interfaces"][1].update(up=False),
     ("interface", "node2"), "doctor.interface-down",
     {"interface": "veth0"}),
    ("interface-no-ipv4", CLUSTER, lambda d: d["node1"]["facts"]["interfaces"][1].update(ipv4=[]),
     ("interface", "node1"), "doctor.interface-no-ipv4",
     {"interface": "veth0"}),
    ("wrong-route", CLUSTER, _set("node1.facts.peers.node2.route_dev", "docker0"),
     ("interface", "node1"), "doctor.routes-elsewhere",
     {"routes": "node2 via docker0", "interface": "veth0", "other": "docker0"}),
    ("other-subnet", CLUSTER,
     lambda d: d["node2"]["facts"]["interfaces"][1].update(ipv4=["192.168.5.2/24"]),
     ("interface", "node2"), "doctor.other-subnet",
     {"address": "192.168.5.2/24", "first": "node0", "network": "10.9.0.0/24"}),
    ("hostname-loopback", CLUSTER, _set("node1.facts.hostname_addrs", ["127.0.1.1"]),
     ("hostname", "node1"), "doctor.hostname-loopback",
     {"loopback": "127.0.1.1", "address": "10.9.0.12"}),
    ("master-unresolved", CLUSTER, _set("node2.facts.master.addrs", []),
     ("hostname", "node2"), "doctor.master-unresolved",
     {"master": "node0"}),
    ("peer-resolves-elsewhere", CLUSTER, _set("node0.facts.peers.node1.addrs", ["10.9.0.99"]),
     ("hostname", "node0"), "doctor.peers-resolve-apart",
     {"peers": "node1 -> 10.9.0.99 (its interface has 10.9.0.12)"}),
    ("master-port-taken", CLUSTER,
     _set("node0.facts.listening", {"master": None, "ephemeral": 40000,
                                    "master_error": "Address already in use"}),
     ("master port", "node0"), "doctor.master-port-in-use",
     {"error": "Address already in use"}),
    ("master-port-unreachable", CLUSTER, _failed_connect("node2", "master"),
     ("master port", "node2"), "doctor.master-port-unreachable",
     {"master": "node0", "port": "29500", "error": "Connection timed out"}),
    ("master-port-ephemeral", "nodes: [{host: node0}, {host: node1}]\nmaster: {port: 40000}\n",
     lambda d: [c.update(port=40000) for h in d for c in d[h]["connects"]
                if c["label"] == "master"], ("master port", "node0"),
     "doctor.master-port-ephemeral",
     {"port": "40000", "low": "32768", "high": "60999"}),
    ("ephemeral-blocked", CLUSTER, _failed_connect("node0", "peer:node2"), ("ports", "node0"),
     "doctor.peer-port-unreachable",
     {"peer": "node2", "host": "10.9.0.13", "more": ""}),
    ("workdir-missing", CLUSTER, _set("node1.facts.workdir.exists", False),
     ("workdir", "node1"), "doctor.workdir-missing",
     {"path": "/work/main"}),
    ("shm-small", CLUSTER, _set("node2.facts.shm", {"free": 1 << 26, "total": 1 << 26}),
     ("resources", "node2"), "doctor.shm-small",
     {"total": "0.06"}),
    ("disk-low", CLUSTER, _set("node0.facts.disk", {"free": 1 << 30, "total": 1 << 40}),
     ("resources", "node0"), "doctor.workdir-disk-low",
     {"free": "1.0"}),
    ("clock-skew", CLUSTER, _set("node1.clock_offset", 3.5), ("clock", "node1"),
     "doctor.clock-skew",
     {"offset": "+3.5"}),
]


@pytest.mark.parametrize("text,mutate,where,code,fields", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_each_fault_is_named_on_its_node(text, mutate, where, code, fields) -> None:
    found = fails(text, mutate)
    assert where in found, found
    assert found[where].code == code, found[where]
    assert fields.items() <= found[where].fields.items(), found[where].fields
    assert found[where].fix


def test_unreached_node_skips_its_checks_and_fails_ssh() -> None:
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    probes = probes_from(copy.deepcopy(RECORDED))
    probes["node2"] = NodeReport(host="node2", problem=Problem(
        None, "cannot reach the node over ssh (x)", "check it"))
    findings = run_checks(spec, probes)
    node2 = {f.check: f.status for f in findings if f.host == "node2"}
    assert node2["ssh"] == "fail" and node2["versions"] == "skip"
    assert not [f for f in findings if f.host != "node2" and f.status == "fail"]


@pytest.mark.parametrize("slurm_job, words", [(None, "BatchMode ssh ok"),
                                               ("4242", "srun step in job 4242 ok")])
def test_the_reach_row_says_how_the_node_was_reached(slurm_job, words) -> None:
    spec = dataclasses.replace(parse_cluster_text(CLUSTER, "c.yaml"), slurm_job=slurm_job)
    row = {f.host: f.detail for f in run_checks(spec, probes_from(copy.deepcopy(RECORDED)))
           if f.check == "ssh"}
    assert set(row) == {"node0", "node1", "node2"}, row
    assert all(d.startswith(words) for d in row.values()), row


def test_gpu_facts_of_a_healthy_gpu_cluster_pass() -> None:
    found = fails(CLUSTER, _gpu("580.82.07", 2, cuda="13.0", cuda_driver="13.0"))
    assert {where: (f.code, f.fields) for where, f in found.items()} == {
        ("gpus", h): ("doctor.gpus-unused", {"count": "2", "slots": "1"})
        for h in ("node1", "node2")}
    assert found[("gpus", "node1")].line() == (  # (the one rendering: who: what. Fix: how)
        "node1: 2 GPUs, only 1 used (slots). Fix: set slots: 2 to use them all")


def test_unlisted_interfaces_are_not_reported_as_missing() -> None:
    found = fails("nodes: [{host: node0}, {host: node1, interface: veth0}]\n",
                  lambda d: d["node1"]["facts"].update(
                      interfaces=[], interfaces_error="`ip -j addr show` output does not parse"))
    assert found[("interface", "node1")].code == "doctor.interfaces-unlisted"


@pytest.mark.parametrize("exit_code,kind,ssh,python", [
    (127, ProblemKind.PYTHON, "ok", "fail"),      # bash: /x/python3: No such file or directory
    (126, ProblemKind.PYTHON, "ok", "fail"),      # not executable
    (255, ProblemKind.SSH, "fail", "skip"),       # ssh: Permission denied (publickey)
    (1, ProblemKind.COMMAND, "fail", "skip"),     # the probe raised
    (None, ProblemKind.NO_ANSWER, "fail", "skip"),  # never started
    (-9, ProblemKind.NO_ANSWER, "fail", "skip"),  # killed after the timeout
])
def test_problem_kind_comes_from_the_exit_status(exit_code, kind, ssh, python) -> None:
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    probes = probes_from(copy.deepcopy(RECORDED))
    # the wording must not matter: "python" in an ssh failure's text is not a python problem
    probes["node2"] = NodeReport(host="node2", exit_code=exit_code,
                                problem=Problem(None, "python? (x)", "f"))
    assert probes["node2"].kind is kind and probes["node0"].kind is None
    node2 = {f.check: f.status for f in run_checks(spec, probes) if f.host == "node2"}
    assert (node2["ssh"], node2["python"]) == (ssh, python)


# -- the probe's parsers, on recorded strings -----------------------------------------------------

H200 = "NVIDIA H200, 580.82.07, 143771, 9.0"


@pytest.mark.parametrize("text,fields,count,names,driver,memory,capability", [
    ("\n".join([H200] * 8) + "\n", accel.SMI_FIELDS, 8, ["NVIDIA H200"] * 8, "580.82.07",
     [143771] * 8, ["9.0"] * 8),
    ("NVIDIA A100-SXM4-80GB, 535.154.05, 81920\nNVIDIA A100-SXM4-80GB, 535.154.05, 81920\n",
     accel.SMI_FIELDS[:3], 2, ["NVIDIA A100-SXM4-80GB"] * 2, "535.154.05", [81920] * 2,
     [None, None]),  # nvidia-smi before compute_cap existed
    ("NVIDIA GeForce RTX 4090, 550.54.15, [N/A], 8.9\n", accel.SMI_FIELDS, 1,
     ["NVIDIA GeForce RTX 4090"], "550.54.15", [None], ["8.9"]),
    ("Tesla, V100, 470.82.01, 32768, 7.0\n", accel.SMI_FIELDS, 1, ["Tesla, V100"],
     "470.82.01", [32768], ["7.0"]),  # a comma in the name stays in the name
    ("", accel.SMI_FIELDS, 0, [], None, [], []),
])
def test_nvidia_smi_csv(text, fields, count, names, driver, memory, capability) -> None:
    g = accel.parse_nvidia_smi_csv(text, fields)
    assert (g["count"], g["names"], g["driver"], g["memory_mib"], g["compute_capability"]) == \
        (count, names, driver, memory, capability)
    assert g["source"] == "nvidia-smi" and g["error"] is None


def test_nvidia_smi_csv_rejects_other_text() -> None:
    with pytest.raises(ValueError):
        accel.parse_nvidia_smi_csv("NVIDIA-SMI has failed because it couldn't communicate with "
                                   "the NVIDIA driver. Make sure that the latest NVIDIA driver is "
                                   "installed and running.")


@pytest.mark.parametrize("text,version", [
    ("580.82.07\n", "580.82.07"),  # /sys/module/nvidia/version
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.154.05  Thu Dec 28 15:37:48 UTC 2023\n"
     "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14) \n", "535.154.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
     "(dvs-builder@U16-I3-B14-1-1)  Sun Jul 27 07:09:14 UTC 2025\n"
     "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04) \n", "580.65.06"),
    ("GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n", None),
    ("", None),
])
def test_driver_version_files(text, version) -> None:
    assert accel.parse_driver_version(text) == version


VERSION_PY_CU130 = """from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '2.13.0+cu130'
debug = False
cuda: Optional[str] = '13.0'
git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'
hip: Optional[str] = None
rocm: Optional[str] = None
xpu: Optional[str] = None
"""
VERSION_PY_CPU = VERSION_PY_CU130.replace("+cu130", "+cpu").replace("'13.0'", "None")


@pytest.mark.parametrize("text,version,cuda,hip", [
    (VERSION_PY_CU130, "2.13.0+cu130", "13.0", None),
    (VERSION_PY_CPU, "2.13.0+cpu", None, None),
    ("__version__ = '1.13.1+cu117'\ndebug = False\ncuda = '11.7'\n"
     "git_version = '49444c3e546bf240bed24a101e747422d1f8a0ee'\nhip = None\n",
     "1.13.1+cu117", "11.7", None),
    ("from typing import Optional\n__version__ = '2.5.1+rocm6.2'\n"
     "cuda: Optional[str] = None\nhip: Optional[str] = '6.2.41133-dd7f95766'\n",
     "2.5.1+rocm6.2", None, "6.2.41133-dd7f95766"),
])
def test_torch_version_py(text, version, cuda, hip) -> None:
    got = accel.parse_version_py(text)
    assert (got["__version__"], got["cuda"], got.get("hip")) == (version, cuda, hip)


def test_torch_version_py_is_never_executed(tmp_path) -> None:
    marker = tmp_path / "ran"
    got = accel.parse_version_py(f"__version__ = '2.13.0'\n"
                                 f"cuda = __import__('os').mkdir({str(marker)!r})\n")
    assert got == {"__version__": "2.13.0"} and not marker.exists()


@pytest.mark.parametrize("name,stem,version", [
    ("libnccl.so.2.27.7", "libnccl", "2.27.7"),
    ("libnccl.so.2.21.5", "libnccl", "2.21.5"),
    ("libnccl.so.2", "libnccl", None),  # the major version only: not enough
    ("libnccl.so", "libnccl", None),
    ("libnccl.so.2.27.7.bak", "libnccl", None),
    ("libnccl-net.so", "libnccl", None),
    ("libcudnn.so.9.13.0", "libcudnn", "9.13.0"),
    ("libcudnn_ops.so.9.13.0", "libcudnn", None),
])
def test_library_file_names(name, stem, version) -> None:
    assert accel.lib_file_version(name, stem) == version


def test_library_version_follows_the_soname_link(tmp_path) -> None:
    first, system = tmp_path / "torch_lib", tmp_path / "system"
    first.mkdir()
    system.mkdir()
    (system / "libnccl.so.2.18.1").write_bytes(b"")
    assert accel.lib_version("libnccl", [str(first), str(system)]) == \
        ("2.18.1", str(system / "libnccl.so.2.18.1"))
    (first / "libnccl.so.2.27.7").write_bytes(b"")
    (first / "libnccl.so.2.28.3").write_bytes(b"")  # newer, but not the one the loader opens
    (first / "libnccl.so.2").symlink_to("libnccl.so.2.27.7")
    assert accel.lib_version("libnccl", [str(first), str(system)]) == \
        ("2.27.7", str(first / "libnccl.so.2"))
    (first / "libnccl.so.2").unlink()
    assert accel.lib_version("libnccl", [str(first)]) == \
        ("2.28.3", str(first / "libnccl.so.2.28.3"))


def test_required_names() -> None:
    requires = ['filelock', 'nvidia-cuda-nvrtc==13.0.88; platform_system == "Linux"',
                'nvidia-cudnn-cu13==9.13.0.50; platform_system == "Linux"',
                'nvidia_nccl_cu13==2.27.7; platform_system == "Linux"',
                'optree>=0.13.0; extra == "optree"']
    assert accel.required_names(requires, "nvidia-nccl") == ["nvidia_nccl_cu13"]
    assert accel.required_names(requires, "nvidia-cudnn") == ["nvidia-cudnn-cu13"]


def _dist_info(site: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True)
    (folder / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" +
        "".join(f"Requires-Dist: {r}\n" for r in requires))


def _torch_facts(site: Path) -> dict[str, Any]:
    """torch_facts() in a fresh interpreter that sees only ``site`` (no site-packages); the
    probe's modules are loaded as they are shipped (``node.importer``)."""
    packed = site.parent / "probe_packed.py"
    sources = {m: module_source(m) for m in shipped(PROBE_PROGRAM)}
    packed.write_text(module_source(IMPORTER) + "\nimport json\n"  # as the node gets them
                      + f"probe = load({sources!r}, {accel.__name__!r})\n"
                      "probe.SYSTEM_LIB_DIRS = ()\n"
                      "print(json.dumps(probe.torch_facts()))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-S", str(packed)], env={**env, "PYTHONPATH": str(site)},
                         cwd=site.parent, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _torch(site: Path, version_py: str | None) -> Path:
    root = site / "torch"
    (root / "lib").mkdir(parents=True)
    (root / "__init__.py").write_text("raise SystemExit('the probe must not import torch')\n")
    if version_py is not None:
        (root / "version.py").write_text(version_py)
    return root


def test_torch_facts_cpu_build(tmp_path) -> None:
    site = tmp_path / "site"
    _torch(site, VERSION_PY_CPU)
    _dist_info(site, "torch", "2.13.0+cpu", ("filelock",))
    t = _torch_facts(site)
    assert t["ok"] and (t["version"], t["cuda"], t["nccl"], t["cudnn"]) == \
        ("2.13.0+cpu", None, None, None)
    assert t["unknown"] == {} and t["source"]["version"] == "package metadata"


def test_torch_facts_cuda_build_with_nvidia_wheels(tmp_path) -> None:
    site = tmp_path / "site"
    _torch(site, VERSION_PY_CU130)
    _dist_info(site, "torch", "2.13.0+cu130",
               ('nvidia-cudnn-cu13==9.13.0.50; platform_system == "Linux"',
                'nvidia-nccl-cu13==2.27.7; platform_system == "Linux"'))
    _dist_info(site, "nvidia-nccl-cu13", "2.27.7")
    _dist_info(site, "nvidia-cudnn-cu13", "9.13.0.50")
    t = _torch_facts(site)
    assert (t["version"], t["cuda"], t["nccl"], t["cudnn"]) == \
        ("2.13.0+cu130", "13.0", "2.27.7", "9.13.0.50")
    assert t["source"]["nccl"] == "nvidia-nccl-cu13 package" and t["unknown"] == {}


def test_torch_facts_nccl_from_a_library_file_else_unknown(tmp_path) -> None:
    site = tmp_path / "site"
    root = _torch(site, VERSION_PY_CU130)
    _dist_info(site, "torch", "2.13.0+cu130")
    t = _torch_facts(site)
    assert t["nccl"] is None and "nccl" in t["unknown"] and "cudnn" in t["unknown"]
    (root / "lib" / "libnccl.so.2.27.7").write_bytes(b"")
    t = _torch_facts(site)
    assert t["nccl"] == "2.27.7" and "nccl" not in t["unknown"]
    assert t["source"]["nccl"].endswith("torch/lib/libnccl.so.2.27.7")


def test_torch_facts_not_installed_is_not_unknown(tmp_path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    t = _torch_facts(site)
    assert not t["ok"] and t["unknown"] == {}
    assert t["error"] == f"torch is not installed for {sys.executable}"
    _torch(site, "cuda = ")  # there, but its version.py is broken and it has no metadata
    t = _torch_facts(site)
    assert t["ok"] and t["version"] is None and set(t["unknown"]) == {"torch", "cuda", "nccl",
                                                                      "cudnn"}


class FakeNvml:
    """Stands in for ctypes.CDLL("libnvidia-ml.so.1"): two H200s, driver 580.82.07."""

    def __init__(self, init_code: int = 0, count: int = 2) -> None:
        self.init_code, self.count, self.shut = init_code, count, False
        self.nvmlErrorString = lambda code: {9: b"Driver Not Loaded",
                                             18: b"Driver/library version mismatch"}[code]

    def nvmlInit_v2(self) -> int:
        return self.init_code

    def nvmlShutdown(self) -> int:
        self.shut = True
        return 0

    def nvmlSystemGetDriverVersion(self, buf: Any, size: int) -> int:
        buf.value = b"580.82.07"
        return 0

    def nvmlSystemGetCudaDriverVersion_v2(self, out: Any) -> int:
        out.contents.value = 13000
        return 0

    def nvmlDeviceGetCount_v2(self, out: Any) -> int:
        out.contents.value = self.count
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index: int, out: Any) -> int:
        out.contents.value = 0x1000 + index
        return 0

    def nvmlDeviceGetName(self, handle: Any, buf: Any, size: int) -> int:
        buf.value = b"NVIDIA H200"
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle: Any, out: Any) -> int:
        out.contents[0] = 143771 << 20  # total; then free, used
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any, major: Any, minor: Any) -> int:
        major.contents.value, minor.contents.value = 9, 0
        return 0


def test_nvml_reader() -> None:
    nvml = FakeNvml()
    g = accel.read_nvml(nvml)
    assert g == {"count": 2, "names": ["NVIDIA H200"] * 2, "memory_mib": [143771] * 2,
                 "compute_capability": ["9.0"] * 2, "driver": "580.82.07",
                 "cuda_driver": "13.0", "source": "nvml", "error": None}
    assert nvml.shut


def test_nvml_without_driver_is_no_gpu_and_a_broken_one_says_why() -> None:
    assert accel.read_nvml(FakeNvml(init_code=9)) == accel.no_gpus()
    g = accel.read_nvml(FakeNvml(init_code=18))
    assert g["count"] == 0 and g["error"] == "nvmlInit: Driver/library version mismatch"


def test_no_gpu_here_is_clean() -> None:
    """This machine (CI, the testbed) has no NVIDIA driver: no GPU, no error."""
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA driver")
    assert accel.gpus() == accel.no_gpus()


@pytest.mark.parametrize(("per_rank", "named"), [
    ([0.20, 0.21, 0.22, 0.20], set()),  # balanced (ranks 0,1 on n1; 2 on n2; 3 on n3)
    ([0.20, 0.21, 0.22, 0.80], {"n3"}),  # n3 3.8x the others' median
    ([0.20, 0.90, 0.22, 0.20], {"n1"}),  # a node's figure is its slowest rank
    ([0.20, 0.21, 0.30, 0.20], set()),  # 1.43x: within the margin
])
def test_compute_probe_names_the_node_slower_than_the_others(per_rank, named) -> None:
    from ptcluster.doctor.compute import compute_findings

    spec = parse_cluster_text("nodes:\n  - {host: n1, slots: 2}\n  - {host: n2, slots: 1}\n"
                              "  - {host: n3, slots: 1}\n", "c.yaml")
    found = {f.host: f for f in compute_findings(spec, per_rank)}
    assert set(found) == {"n1", "n2", "n3"}
    assert {h for h, f in found.items() if f.status == "warn"} == named
    for host in named:
        assert found[host].code == "doctor.slow-node" and found[host].fix
        assert set(found[host].fields) == {"seconds", "ratio", "median"}
    assert compute_findings(spec, [0.1]) == []  # not one figure per rank: nothing to say


def test_compute_probe_with_two_nodes_and_with_one() -> None:
    from ptcluster.doctor.compute import compute_findings

    two = parse_cluster_text("nodes:\n  - {host: a}\n  - {host: b}\n", "c.yaml")
    assert [f.status for f in compute_findings(two, [0.2, 0.8])] == ["ok", "warn"]
    one = parse_cluster_text("nodes:\n  - {host: a}\n", "c.yaml")
    (only,) = compute_findings(one, [0.2])
    assert (only.status, only.detail) == ("ok", "probe 0.200 s (one node: nothing to compare "
                                           "with)")
