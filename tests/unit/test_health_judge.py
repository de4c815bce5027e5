"""The health gate's judge (``node.facts.health.judge``) on recorded facts of whole nodes: what a
guard refuses and what it lets in, with no I/O of its own (``read_health`` reads, the judge
only judges)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from ptcluster.node.facts.health import gpu_warnings, judge, unfit
from ptcluster.node.facts.health_facts import HealthFacts
from tests.support.health import GIB, MIB, checkpoint, driver, facts

TIB = 1024 * GIB
H100 = {"ecc_uncorrected": 0, "remap_pending": False, "remap_failed": False,
        "pcie": (16, 16, 5, 5), "util": 0, "slowdowns": []}
"""NVML's state of a healthy H100 (``gpu_errors.nvml_state``'s record), idle."""
PCI = {f"0000:{0x18 + 16 * i:02x}:00": i for i in range(8)}
LOADED = (12.5, "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 "
                "09:35:42 UTC 2024")
XID_13 = (4000.0, "NVRM: Xid (PCI:0000:28:00): 13, pid=2211, name=python, Graphics SM Warp "
                  "Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter")
XID_79 = (5000.0, "NVRM: Xid (PCI:0000:88:00): 79, pid='<unknown>', name=<unknown>, GPU has "
                  "fallen off the bus.")


def dgx(**changed: Any) -> HealthFacts:
    """An 8-GPU node as its guard reads it before an NCCL job: 1.2 of 3.5 TiB free, 1.8 of
    2 TiB memory available, the driver loaded at boot, an application's Xid 13 since."""
    state = [{"index": i, "pci": pci, **H100} for pci, i in PCI.items()]
    return facts(**{"workdir": "/scratch/job", "slots": 8, "backend": "nccl", "gpu_count": 8,
                    "disk": (int(1.2 * TIB), int(3.5 * TIB)),
                    "memory": (int(1.8 * TIB), 2 * TIB),
                    "driver": driver([LOADED, XID_13], state, PCI), **changed})


def codes(found: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    return [(f["check"], f["code"]) for f in found]


def test_a_healthy_gpu_node_is_let_in() -> None:
    found = judge(dgx())
    assert codes(found) == [("gpus", None), ("disk", None), ("memory", None),
                            ("gpu-driver", None)]
    assert all(f["ok"] for f in found) and unfit(found) is None
    assert gpu_warnings(dgx()) == []


def test_a_full_workdir_disk_is_refused() -> None:
    found = judge(dgx(disk=(200 * MIB, 100 * GIB)))
    refusal = unfit(found)
    assert refusal is not None and refusal["code"] == "health.workdir-disk-full"
    assert refusal["fields"] == {"free": "200 MiB", "total": "100.0 GiB",
                                 "path": "/scratch/job", "floor": "1.0 GiB", "share": "5%"}


def test_a_gpu_that_fell_off_the_bus_is_refused_twice_over() -> None:
    """The driver's Xid 79 after its load, and the GPU gone from NVML's count: both said, the
    count first; the GPU's name comes from the PCI address in the Xid line."""
    state = [{"index": i, "pci": pci, **H100} for pci, i in PCI.items() if i != 7]
    found = judge(dgx(gpu_count=7, driver=driver([LOADED, XID_13, XID_79], state, PCI)))
    assert [c for c in codes(found) if c[1]] == [("gpus", "health.gpus-fewer"),
                                                 ("gpu-driver", "health.xid-fatal")]
    refusal = unfit(found)
    assert refusal is not None and refusal["code"] == "health.gpus-fewer"
    (xid,) = [f for f in found if f["code"] == "health.xid-fatal"]
    assert (xid["fields"]["name"], xid["fields"]["xid"]) == ("GPU 7 (PCI 0000:88:00)", "79")


def test_the_same_xid_before_a_driver_reload_is_history() -> None:
    found = judge(dgx(driver=driver([XID_79, (6000.0, LOADED[1])], [], PCI)))
    assert unfit(found) is None


def test_worn_memory_refuses_and_a_slow_link_only_warns() -> None:
    state = [{"index": 0, "pci": "0000:18:00", **H100, "remap_pending": True},
             {"index": 1, "pci": "0000:28:00", **H100, "pcie": (8, 16, 5, 5)}]
    node = dgx(slots=2, gpu_count=2, driver=driver([LOADED], state, PCI))
    assert [c for c in codes(judge(node)) if c[1]] == [("gpu-driver", "health.remap-pending")]
    assert [w["code"] for w in gpu_warnings(node)] == ["health.pcie-narrow"]


def test_too_little_memory_for_eight_ranks() -> None:
    refusal = unfit(judge(dgx(memory=(GIB + 512 * MIB, 2 * TIB))))
    assert refusal is not None and refusal["code"] == "health.memory-low"
    assert refusal["fields"]["need"] == "2.0 GiB"


def test_a_cpu_node_for_gloo_is_not_asked_of_gpus() -> None:
    node = facts(slots=4, memory=(6 * GIB, 8 * GIB))  # driver not read: None
    assert codes(judge(node)) == [("disk", None), ("memory", None)]
    assert gpu_warnings(node) == []


def test_a_restart_onto_a_checkpoint_disk_without_room() -> None:
    """The last checkpoint's file is 40 GiB, its own filesystem has 30 GiB left: refused; on
    the workdir's filesystem instead, only the room for it is asked there."""
    full = checkpoint("/ckpt/run1/step-900", (30 * GIB, 2 * TIB), largest=40 * GIB)
    refusal = unfit(judge(dgx(checkpoints=[full])))
    assert refusal is not None and refusal["code"] == "health.checkpoint-no-room"
    roomy = checkpoint("/scratch/job/ckpt", (int(1.2 * TIB), int(3.5 * TIB)), 40 * GIB, True)
    assert unfit(judge(dgx(checkpoints=[roomy]))) is None


@pytest.fixture
def io_events() -> Iterator[list[str]]:
    """The audit events of I/O (files opened, folders listed, processes started, libraries
    loaded) while the test runs."""
    seen: list[str] = []
    watched = ("open", "os.listdir", "os.scandir", "subprocess.Popen", "ctypes.dlopen",
               "os.system", "socket.connect")
    active = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if active[0] and event in watched:
            seen.append(event)

    sys.addaudithook(hook)  # (hooks stay for the process: this one goes quiet after)
    yield seen
    active[0] = False


def test_the_judge_reads_nothing(io_events: list[str]) -> None:
    node = dgx(driver=driver([LOADED, XID_79], [], PCI),
               checkpoints=[checkpoint("/nowhere/ck", None, 0)])
    found = judge(node)
    gpu_warnings(node)
    assert io_events == [] and unfit(found) is not None
