"""Is this node fit to run a job's ranks? The health gate the guard runs before any rank starts
(and before every restart: each attempt starts a new guard), and that ``ptcluster doctor`` shows:
one function, ``health``, for both: ``judge`` of the facts ``node.facts.health_facts`` reads.

``judge`` is pure (no I/O: a test gives it recorded facts, ``HealthFacts``). Each check is one
small function of the facts -> ``None`` (not asked) or a finding ``{"check", "ok", "what",
"fix", "code"}`` (several, where one check finds many things); ``CHECKS`` lists them in order.
What it refuses is declared in ``REFUSALS`` (``health.*`` codes: ``node.problems``), what
doctor only warns of in ``WARNINGS``. The last is the GPU driver's own word
(``node.facts.gpu_errors``): a fatal Xid since the driver loaded, uncorrectable ECC errors, row
remapping pending or failed, retired pages pending. ``gpu_warnings`` are what doctor shows
besides (a PCIe link below its width or generation under load, slowdowns, Xids 63 and 92).

Standard library only; a part of the guard, of the doctor's facts program and of the probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypedDict

from ptcluster.node.facts.gpu_errors import (
    ACT_HARDWARE,
    ACT_RESET,
    WARN_XIDS,
    XID_ACTIONS,
    describe_xid,
    open_fatal,
    xid_fix,
    xids_in,
)
from ptcluster.node.facts.health_facts import (
    HealthContext,
    HealthFacts,
    read_health,
    uses_gpus,
)
from ptcluster.node.problems import Declared, Sent

GIB = 1 << 30
DISK_MIN_FREE = GIB
"""A workdir disk is nearly full when less than this is free *and* less than
``DISK_MIN_SHARE`` of it: an absolute floor alone would refuse a small scratch filesystem that
is nearly empty, a share alone a large disk with hundreds of GiB free. 1 GiB is what a few
checkpoints of a small model and the job's logs take."""
DISK_MIN_SHARE = 0.05
"""See ``DISK_MIN_FREE``: 5 % of the filesystem."""
CHECKPOINT_ROOM = 1.2
"""A checkpoint disk needs room for another checkpoint this many times the largest file there
(a save writes a new file beside the last one before it removes an older one)."""
MEM_PER_RANK = 256 << 20
"""Memory the kernel must have available (``MemAvailable``) per rank of the node before it
starts: a Python process that imports torch holds ~300 MiB before any data; below 256 MiB each
the out-of-memory killer takes a rank at import or at its first batch."""

GPUS_FEWER = Declared(
    "health.gpus-fewer", "fewer GPUs than slots",
    "fewer GPUs than slots: {count} GPU(s) for {slots} slot(s){why}",
    "see `nvidia-smi` and the kernel log on it (a GPU that fell off the bus needs a reset or a "
    "reboot), or set slots: to its GPU count")
WORKDIR_DISK_FULL = Declared(
    "health.workdir-disk-full", "the workdir's disk is nearly full",
    "its workdir disk is nearly full: {free} of {total} free on the filesystem of {path}",
    "free space there (old checkpoints, logs), or set workdir: to a filesystem with more room "
    "(refused below {floor} and {share} free)")
CHECKPOINT_DISK_FULL = Declared(
    "health.checkpoint-disk-full", "the checkpoints' disk is nearly full",
    "its checkpoint disk is nearly full: {free} of {total} free on the filesystem of {path}",
    "free space there (old checkpoints, logs), or save checkpoints to a filesystem with more "
    "room (refused below {floor} and {share} free)")
CHECKPOINT_NO_ROOM = Declared(
    "health.checkpoint-no-room", "no room for another checkpoint",
    "its checkpoint disk has no room for another checkpoint: {free} of {total} free on the "
    "filesystem of {path}, its largest checkpoint file is {largest}",
    "free space there (old checkpoints), or save checkpoints to a filesystem with more room")
MEMORY_LOW = Declared(
    "health.memory-low", "too little memory available",
    "too little memory available: {available} of {total} memory available, {slots} rank(s) "
    "need at least {need} ({each} each)",
    "end what holds the memory there (`ps aux --sort=-rss | head` on it), or give the node "
    "fewer slots")
XID_FATAL = Declared(
    "health.xid-fatal", "a fatal Xid since the driver loaded",
    "{name} had Xid {xid} ({meaning}) at {at}, and the driver has not been reloaded since",
    "{action} (NVIDIA's action for Xid {xid})")
ECC_UNCORRECTED = Declared(
    "health.ecc-uncorrected", "uncorrectable ECC errors",
    "{name} has {count} uncorrectable ECC error(s) since the driver loaded",
    XID_ACTIONS[ACT_RESET])
REMAP_FAILED = Declared("health.remap-failed", "a memory row's remapping failed",
                        "{name}: remapping a memory row failed", XID_ACTIONS[ACT_HARDWARE])
REMAP_PENDING = Declared("health.remap-pending", "a memory row remapping pending",
                         "{name} has a memory row remapping pending", XID_ACTIONS[ACT_RESET])
RETIRE_PENDING = Declared("health.retire-pending", "retired memory pages pending",
                          "{name} has retired memory pages pending", XID_ACTIONS[ACT_RESET])
REFUSALS = (GPUS_FEWER, WORKDIR_DISK_FULL, CHECKPOINT_DISK_FULL, CHECKPOINT_NO_ROOM, MEMORY_LOW,
            XID_FATAL, ECC_UNCORRECTED, REMAP_FAILED, REMAP_PENDING, RETIRE_PENDING)
"""What the health gate refuses a node for: ``run`` before any rank starts (a guard's
refusal, ``unhealthy``), doctor's ``health`` row. Each finding names its entry's code."""

PCIE_NARROW = Declared(
    "health.pcie-narrow", "a PCIe link below its width",
    "{name}: PCIe link x{width} of x{max_width} (a slot, riser or cable below its width)",
    "reseat the GPU or its riser and cable, or move it to a slot of its full width")
PCIE_SLOW = Declared(
    "health.pcie-slow", "a PCIe link below its generation while busy",
    "{name}: PCIe gen {gen} of {max_gen} while busy",
    "check the slot's and the BIOS's PCIe settings (`nvidia-smi -q -d PERFORMANCE` on it)")
GPU_SLOWDOWN = Declared(
    "health.gpu-slowdown", "a GPU slows itself down",
    "{name}: {reasons} (check cooling and power)",
    "check its cooling and power (`nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER` on it)")
XID_WEAR = Declared(
    "health.xid-wear", "a GPU's memory wears (Xid 63, 92)",
    "{name}: Xid {xid} at {at} ({meaning})",
    "watch it (`nvidia-smi -q -d ECC,ROW_REMAPPER`); reset the GPU at the next chance")
WARNINGS = (PCIE_NARROW, PCIE_SLOW, GPU_SLOWDOWN, XID_WEAR)
"""What doctor warns of on a GPU that works (``gpu-health``), never refused."""


def size(n: float) -> str:
    """Bytes as a person reads them: ``1.4 GiB``, ``312 MiB``, ``0.6 MiB``."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if 0 < n < 10 << 20 else f"{n / (1 << 20):.0f} MiB"


class _Found(TypedDict):
    check: str
    """Which check (``disk``, ``memory``, ``gpus``, ``gpu-driver``, ``checkpoint-disk``)."""
    ok: bool
    what: str
    fix: str | None
    code: str | None
    """A refusal's (``health.*``); None for what is fine."""


class HealthFinding(_Found, total=False):
    """What one check of the health gate found (:func:`judge`): the guard's refusal, the probe's
    ``unfit`` and doctor's ``health`` section (``doctor.health_checks``) read it."""

    fields: dict[str, str]
    """A refusal's values (``Declared.sent``)."""


def finding(check: str, ok: bool, what: str, fix: str | None = None) -> HealthFinding:
    """What a check found that is fine (no code: ``ok`` True), in words."""
    return {"check": check, "ok": ok, "what": what, "fix": fix, "code": None}


def refused(check: str, entry: Declared, **values: object) -> HealthFinding:
    """A check's refusal, said by its entry (``REFUSALS``), with its code and the values it
    was said with (``fields``)."""
    return {"check": check, "ok": False, **entry.sent(**values)}


def warned(entry: Declared, **values: object) -> Sent:
    """A GPU's warning (``WARNINGS``): ``{code, what, fix, fields}``."""
    return entry.sent(**values)


def check_disk(facts: HealthFacts) -> HealthFinding:
    """The workdir's filesystem: nearly full (``DISK_MIN_FREE``) is refused."""
    return disk_finding("disk", "workdir", facts["workdir"], facts["disk"])


def check_checkpoint_disk(facts: HealthFacts) -> HealthFinding | None:
    """Where the job saved its last checkpoint on this node (a restart: ``checkpoints``): too
    little room for another checkpoint as large as the largest there
    (``CHECKPOINT_ROOM`` times it), or nearly full as a workdir, is refused. A restart would
    otherwise fail the same way at its first save."""
    found = None
    for ck in facts["checkpoints"]:
        space, largest = ck["space"], ck["largest"]
        if space is not None and largest and space[0] < CHECKPOINT_ROOM * largest:
            return refused("checkpoint-disk", CHECKPOINT_NO_ROOM, free=size(space[0]),
                           total=size(space[1]), path=ck["path"], largest=size(largest))
        if ck["beside_workdir"]:
            continue  # (nearly full: the workdir's check says it)
        found = disk_finding("checkpoint-disk", "checkpoint", ck["path"], space)
        if not found["ok"]:
            return found
    return found


def disk_finding(check: str, role: str, path: str,
                 space: tuple[int, int] | None) -> HealthFinding:
    if space is None:
        return finding(check, True, f"free space of {path} unknown")
    free, total = space
    what = f"{size(free)} of {size(total)} free on the filesystem of {path}"
    if free < DISK_MIN_FREE and free < DISK_MIN_SHARE * total:
        return refused(check, WORKDIR_DISK_FULL if role == "workdir" else CHECKPOINT_DISK_FULL,
                       free=size(free), total=size(total), path=path,
                       floor=size(DISK_MIN_FREE), share=f"{DISK_MIN_SHARE:.0%}")
    return finding(check, True, what)


def check_memory(facts: HealthFacts) -> HealthFinding:
    """Memory available for the node's ranks: below ``MEM_PER_RANK`` each is refused."""
    mem = facts["memory"]
    if mem is None:
        return finding("memory", True, "available memory unknown (no /proc/meminfo)")
    available, total = mem
    slots = facts["slots"]
    need = MEM_PER_RANK * slots
    what = f"{size(available)} of {size(total)} memory available"
    if available < need:
        return refused("memory", MEMORY_LOW, available=size(available), total=size(total),
                       slots=slots, need=size(need), each=size(MEM_PER_RANK))
    return finding("memory", True, what)


def check_gpu_count(facts: HealthFacts) -> HealthFinding | None:
    """Fewer GPUs than the node's slots, when the job uses GPUs there (the node has some, or the
    cluster file asks for NCCL). Not asked when the GPUs are chosen already (an explicit
    ``gpus:`` list, or ``CUDA_VISIBLE_DEVICES`` set by Slurm or the user)."""
    count, slots = facts["gpu_count"], facts["slots"]
    if facts["chosen"] or not uses_gpus(count, facts["backend"]):
        return None
    what = f"{count} GPU(s) for {slots} slot(s)"
    if count < slots:
        why = " with backend nccl" if count == 0 else ""
        return refused("gpus", GPUS_FEWER, count=count, slots=slots, why=why)
    return finding("gpus", True, what)


def gpu_name(index: int | None, pci: str) -> str:
    return f"GPU {index} (PCI {pci})" if index is not None else f"the GPU at PCI {pci}"


def when(seconds_since_boot: float, boot_wall: float) -> str:
    """A kernel record's time, as a person reads it."""
    if not boot_wall:
        return f"{seconds_since_boot:.0f} s after boot"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(boot_wall + seconds_since_boot))


def check_gpu_driver(facts: HealthFacts) -> list[HealthFinding] | None:
    """The GPU driver's word, where the job uses GPUs: a fatal Xid since the driver last
    loaded, uncorrectable ECC errors since, a row remapping pending or failed, retired pages
    pending: each refuses the node (one finding each), with NVIDIA's action for it; else one
    finding that says what was read."""
    drv = facts["driver"]
    if drv is None or not uses_gpus(facts["gpu_count"], facts["backend"]):
        return None
    bad: list[HealthFinding] = []
    for xid in open_fatal(xids_in(drv["kernel"])):
        index = drv["pci"].get(xid["pci"])
        said = describe_xid(xid["xid"], xid["text"])
        bad.append(refused("gpu-driver", XID_FATAL, name=gpu_name(index, xid["pci"]),
                           xid=xid["xid"], meaning=said["meaning"],
                           at=when(xid["at"], drv["boot_wall"]),
                           action=xid_fix(said["action"], index)))
    for state in drv["state"]:
        name = gpu_name(state["index"], state.get("pci", "?"))
        gpu = "N" if state["index"] is None else state["index"]
        if state.get("ecc_uncorrected"):
            bad.append(refused("gpu-driver", ECC_UNCORRECTED, name=name, gpu=gpu,
                               count=state["ecc_uncorrected"]))
        if state.get("remap_failed"):
            bad.append(refused("gpu-driver", REMAP_FAILED, name=name))
        elif state.get("remap_pending"):
            bad.append(refused("gpu-driver", REMAP_PENDING, name=name, gpu=gpu))
        if state.get("retire_pending"):
            bad.append(refused("gpu-driver", RETIRE_PENDING, name=name, gpu=gpu))
    if bad:
        return bad
    if not drv["source"]:
        return [finding("gpu-driver", True, "Xids not checked: the kernel log is not readable "
                        "here (root, or a member of group adm where journald runs)")]
    return [finding("gpu-driver", True, f"no fatal Xid since the driver loaded "
                    f"({drv['source']}); NVML: " +
                    ("no error counted" if drv["state"] else "not answering"))]


def gpu_warnings(facts: HealthFacts) -> list[Sent]:
    """What doctor warns of, not refused (``WARNINGS``, each ``{code, what, fix}``): a PCIe
    link below its width (or, while the GPU is busy, its generation: it drops at idle to save
    power), slowdowns, Xids 63 and 92; none where the driver was not read."""
    drv = facts["driver"]
    out: list[Sent] = []
    if drv is None:
        return out
    for state in drv["state"]:
        name = gpu_name(state["index"], state.get("pci", "?"))
        if "pcie" in state:
            width, max_width, gen, max_gen = state["pcie"]
            if width < max_width:
                out.append(warned(PCIE_NARROW, name=name, width=width, max_width=max_width))
            elif gen < max_gen and state.get("util", 0) > 0:
                out.append(warned(PCIE_SLOW, name=name, gen=gen, max_gen=max_gen))
        if state.get("slowdowns"):
            out.append(warned(GPU_SLOWDOWN, name=name, reasons=", ".join(state["slowdowns"])))
    for xid in xids_in(drv["kernel"]):
        if xid["xid"] in WARN_XIDS and not xid["stale"]:
            index = drv["pci"].get(xid["pci"])
            out.append(warned(XID_WEAR, name=gpu_name(index, xid["pci"]), xid=xid["xid"],
                              at=when(xid["at"], drv["boot_wall"]),
                              meaning=describe_xid(xid["xid"])["meaning"]))
    return out


Check = Callable[[HealthFacts], "HealthFinding | list[HealthFinding] | None"]
CHECKS: list[Check] = [check_gpu_count, check_disk, check_checkpoint_disk, check_memory,
                       check_gpu_driver]
"""The health gate, in order: each takes the node's facts and returns a finding, several (one
per reason), or None (not asked here)."""


def judge(facts: HealthFacts) -> list[HealthFinding]:
    """Every check's finding on these facts: pure (no I/O), the gate's whole judgement."""
    out: list[HealthFinding] = []
    for check in CHECKS:
        found = check(facts)
        out.extend([] if found is None else [found] if isinstance(found, dict) else found)
    return out


def health(ctx: HealthContext) -> list[HealthFinding]:
    """The gate on this node: ``judge`` of what ``read_health`` reads."""
    return judge(read_health(ctx))


class Unfit(TypedDict):
    """The health gate's refusal: every failed check's what and fix, each joined by "; ", and
    the first one's code and fields."""

    what: str
    fix: str
    code: str | None
    fields: dict[str, str]


def unfit(findings: list[HealthFinding]) -> Unfit | None:
    """The refusal the findings call for: every failed check's what and fix together, and the
    first one's ``code`` and ``fields`` (the refusal's: ``health.*``); None when the node is
    fit."""
    bad = [f for f in findings if not f["ok"]]
    if not bad:
        return None
    return {"what": "; ".join(f["what"] for f in bad),
            "fix": "; ".join(dict.fromkeys(f["fix"] for f in bad if f["fix"])),
            "code": bad[0]["code"], "fields": bad[0].get("fields") or {}}
