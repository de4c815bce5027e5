"""What the health gate reads of a node (``read_health`` -> ``HealthFacts``): its disks, its
memory, its GPUs, the GPU driver's word (the kernel's log, NVML's counters); the gate's
judgement of them is ``node.facts.health.judge``, pure, on this record (a test gives it
recorded facts); ``node.facts.health.health`` is both, what the guard, doctor's facts program
and the probe run.

Also the node's boot (``boot``: its boot id and uptime), which the guard reports at ready so
that the head can tell, after losing the node, whether it rebooted.

Standard library only; a part of the guard, of the doctor's facts program and of the probe.
"""

from __future__ import annotations

import os
from typing import TypedDict

from ptcluster.node.facts.accel import gpus
from ptcluster.node.facts.gpu_errors import GpuState, gpu_indices, nvml_state
from ptcluster.node.facts.kernel_log import LogRecord, boot_wall, kernel_since_boot

LARGEST_OF = 1000
"""Entries of a checkpoint folder looked at for its largest file."""
BACKEND_NCCL = "nccl"


class CheckpointFacts(TypedDict):
    """Where the job saved its last checkpoint on this node (a restart's ``checkpoints``)."""

    path: str
    """As the job said it (the folder may be gone: the rest is of its nearest folder there)."""
    space: tuple[int, int] | None
    """(bytes free to a user, bytes in all) of its filesystem; None if unknown."""
    largest: int
    """The largest checkpoint file there (0: none)."""
    beside_workdir: bool
    """On the workdir's filesystem (how full that is, the workdir's check says)."""


class DriverFacts(TypedDict):
    """The GPU driver's word: the kernel's records of this boot and NVML's counters."""

    kernel: list[LogRecord]
    source: str
    """Where the records were read ("": the log is not readable here)."""
    state: list[GpuState]
    """``gpu_errors.nvml_state`` ([] where NVML does not answer)."""
    pci: dict[str, int]
    """PCI address (``gpu_errors.pci_key``) -> GPU index."""
    boot_wall: float
    """The wall time the node booted (0.0: unknown)."""


class HealthFacts(TypedDict):
    """Everything the gate judges, read once (``read_health``) or recorded (a test)."""

    workdir: str
    slots: int
    """The node's ranks (at least 1)."""
    backend: str | None
    """The cluster file's (``nccl`` asks for GPUs even where none is found)."""
    chosen: bool
    """GPUs named already (``gpus:``, ``CUDA_VISIBLE_DEVICES``): not counted."""
    gpu_count: int
    disk: tuple[int, int] | None
    """(free, total) bytes of the workdir's filesystem; None if unknown."""
    memory: tuple[int, int] | None
    """(MemAvailable, MemTotal) bytes; None if unknown."""
    checkpoints: list[CheckpointFacts]
    driver: DriverFacts | None
    """None where the job uses no GPU here (not read)."""


def uses_gpus(gpu_count: int, backend: str | None) -> bool:
    """The job uses this node's GPUs: it has some, or the cluster file asks for NCCL."""
    return gpu_count > 0 or backend == BACKEND_NCCL


class _Workdir(TypedDict):
    workdir: str
    """This node's path."""


class HealthContext(_Workdir, total=False):
    """What the gate is asked about (the guard's prechecks, doctor's facts program, and the
    head for a lost node's probe: ``launch.plan.health_context``)."""

    slots: int | None
    backend: str | None
    """The cluster file's."""
    chosen: bool
    """GPUs named already (``gpus:``, CUDA_VISIBLE_DEVICES): their count is not judged."""
    checkpoints: list[str]
    """Where the job saved its last checkpoint on this node."""
    gpu_count: int
    """Where the caller read it already (doctor's facts program), and the workdir's ``disk``."""
    disk: tuple[int, int] | None


def read_health(ctx: HealthContext) -> HealthFacts:
    """The facts of this node the gate judges."""
    workdir = str(ctx["workdir"])
    count = int(ctx["gpu_count"]) if "gpu_count" in ctx else int(gpus().get("count") or 0)
    backend = ctx.get("backend")
    return {"workdir": workdir, "slots": max(1, int(ctx.get("slots") or 1)), "backend": backend,
            "chosen": bool(ctx.get("chosen")), "gpu_count": count,
            "disk": ctx["disk"] if "disk" in ctx else disk_space(workdir),
            "memory": memory(),
            "checkpoints": [checkpoint(path, workdir) for path in ctx.get("checkpoints") or []],
            "driver": driver() if uses_gpus(count, backend) else None}


def checkpoint(path: str, workdir: str) -> CheckpointFacts:
    there = existing(path)
    return {"path": path, "space": disk_space(there), "largest": largest_file(there),
            "beside_workdir": same_filesystem(there, workdir)}


def driver() -> DriverFacts:
    records, source = kernel_since_boot()
    state = nvml_state()
    return {"kernel": records, "source": source, "state": state,
            "pci": {s["pci"]: s["index"] for s in state if s.get("pci")} or gpu_indices(),
            "boot_wall": boot_wall()}


class BootFacts(TypedDict, total=False):
    """This node's boot (:func:`boot`; each absent where unreadable): a guard's ready facts and
    the lost-node probe's answer carry them (``wire.ReadyFacts``, ``probe.BootAnswer``)."""

    boot_id: str
    """``/proc/sys/kernel/random/boot_id``: a new one after a loss means the node rebooted."""
    uptime: float
    """Seconds since it booted."""


def boot() -> BootFacts:
    """This node's boot id and uptime."""
    out: BootFacts = {}
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            out["boot_id"] = f.read().strip()
    except OSError:
        pass
    try:
        with open("/proc/uptime") as f:
            out["uptime"] = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def disk_space(path: str) -> tuple[int, int] | None:
    """(bytes free to a user, bytes in all) of the filesystem of ``path``; None if unknown."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def memory() -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes from ``/proc/meminfo``; None if unknown."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(found) < 2:
        return None
    return found["MemAvailable"], found["MemTotal"]


def largest_file(path: str) -> int:
    """The size of ``path`` (a file), or of the largest file in it (a folder; its first
    ``LARGEST_OF`` entries); 0 when there is none."""
    try:
        if not os.path.isdir(path):
            return os.stat(path).st_size
        with os.scandir(path) as entries:
            sizes = [e.stat(follow_symlinks=False).st_size for _, e in zip(
                range(LARGEST_OF), entries, strict=False) if e.is_file(follow_symlinks=False)]
    except OSError:
        return 0
    return max(sizes, default=0)


def same_filesystem(a: str, b: str) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def existing(path: str) -> str:
    """``path``, or its nearest folder that exists (a checkpoint folder may be gone)."""
    while path and not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
