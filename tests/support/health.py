"""Recorded facts for the health gate's pure judge (``node.facts.health.judge``): a node's
``HealthFacts`` as ``node.facts.health_facts.read_health`` would read them, with what a test
changes."""

from __future__ import annotations

from typing import Any

from ptcluster.node.facts.health_facts import CheckpointFacts, DriverFacts, HealthFacts
from ptcluster.node.facts.kernel_log import LogRecord

MIB = 1 << 20
GIB = 1 << 30

NO_DRIVER: DriverFacts = {"kernel": [], "source": "", "state": [], "pci": {}, "boot_wall": 0.0}
"""The GPU driver's facts of a node whose driver said nothing (and whose log is not read)."""


def facts(**changed: Any) -> HealthFacts:
    """A healthy node without GPUs (one slot, 8 of 9 GiB free, 1 of 2 GiB memory available),
    with ``changed`` (any ``HealthFacts`` key)."""
    base: HealthFacts = {"workdir": "/w", "slots": 1, "backend": None, "chosen": False,
                         "gpu_count": 0, "disk": (8 * GIB, 9 * GIB), "memory": (GIB, 2 * GIB),
                         "checkpoints": [], "driver": None}
    unknown = set(changed) - set(base)
    assert not unknown, f"not a HealthFacts key: {unknown}"
    return {**base, **changed}  # type: ignore[typeddict-item]


def checkpoint(path: str, space: tuple[int, int] | None, largest: int = 0,
               beside_workdir: bool = False) -> CheckpointFacts:
    return {"path": path, "space": space, "largest": largest, "beside_workdir": beside_workdir}


def driver(records: list[LogRecord], state: list[dict[str, Any]] | None = None,
           pci: dict[str, int] | None = None, source: str = "/dev/kmsg") -> DriverFacts:
    """The driver's word: the kernel's records of this boot (``(seconds since boot, text)``)
    and NVML's state per GPU; GPU 0 at PCI 0000:cb:00 and GPU 1 at 0000:05:00 unless ``pci``."""
    return {"kernel": records, "source": source, "state": state or [],
            "pci": {"0000:05:00": 1, "0000:cb:00": 0} if pci is None else pci, "boot_wall": 0.0}
