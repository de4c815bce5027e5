"""Is this node fit to run a job's ranks? The health gate the guard runs before any rank starts
(and before every restart: each attempt starts a new guard), and that ``ptcluster doctor`` shows:
one function, ``health``, for both.

Each check is one small function of facts read here -> ``None`` (fine) or a finding ``{"check",
"ok", "what", "fix"}``; ``CHECKS`` lists them in order. The GPU driver's own word (Xids, ECC,
row remapping, from the kernel log) belongs in ``CHECKS`` too, as further functions of the same
shape.

Also the node's boot (``boot``: its boot id and uptime), which the guard reports at ready so
that the head can tell, after losing the node, whether it rebooted.

Standard library only; a part of the guard and of the doctor's facts program.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ptcluster.node.accel import gpus  # inlined

GIB = 1 << 30
DISK_MIN_FREE = GIB
"""A workdir disk is nearly full when less than this is free *and* less than
``DISK_MIN_SHARE`` of it: an absolute floor alone would refuse a small scratch filesystem that
is nearly empty, a share alone a large disk with hundreds of GiB free. 1 GiB is what a few
checkpoints of a small model and the job's logs take."""
DISK_MIN_SHARE = 0.05
"""See ``DISK_MIN_FREE``: 5 % of the filesystem."""
MEM_PER_RANK = 256 << 20
"""Memory the kernel must have available (``MemAvailable``) per rank of the node before it
starts: a Python process that imports torch holds ~300 MiB before any data; below 256 MiB each
the out-of-memory killer takes a rank at import or at its first batch."""
BACKEND_NCCL = "nccl"


def boot() -> dict[str, Any]:
    """``{"boot_id", "uptime"}`` of this node (either missing where unreadable): a new boot id
    after a loss means the node rebooted."""
    out: dict[str, Any] = {}
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


def size(n: float) -> str:
    """Bytes as a person reads them: ``0.4 GiB``, ``312 MiB``."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.0f} MiB"


def finding(check: str, ok: bool, what: str, fix: str | None = None) -> dict[str, Any]:
    return {"check": check, "ok": ok, "what": what, "fix": fix}


def check_disk(ctx: dict[str, Any]) -> dict[str, Any]:
    """The workdir's filesystem: nearly full (``DISK_MIN_FREE``) is refused."""
    path = ctx["workdir"]
    space = ctx["disk"] if "disk" in ctx else disk_space(path)
    if space is None:
        return finding("disk", True, f"free space of {path} unknown")
    free, total = space
    what = f"{size(free)} of {size(total)} free on the filesystem of {path}"
    if free < DISK_MIN_FREE and free < DISK_MIN_SHARE * total:
        return finding("disk", False, f"its workdir disk is nearly full: {what}",
                       f"free space there (old checkpoints, logs), or set workdir: to a "
                       f"filesystem with more room (refused below {size(DISK_MIN_FREE)} and "
                       f"{DISK_MIN_SHARE:.0%} free)")
    return finding("disk", True, what)


def check_memory(ctx: dict[str, Any]) -> dict[str, Any]:
    """Memory available for the node's ranks: below ``MEM_PER_RANK`` each is refused."""
    mem = ctx["memory"] if "memory" in ctx else memory()
    if mem is None:
        return finding("memory", True, "available memory unknown (no /proc/meminfo)")
    available, total = mem
    slots = max(1, int(ctx.get("slots") or 1))
    need = MEM_PER_RANK * slots
    what = f"{size(available)} of {size(total)} memory available"
    if available < need:
        return finding("memory", False,
                       f"too little memory available: {what}, {slots} rank(s) need at least "
                       f"{size(need)} ({size(MEM_PER_RANK)} each)",
                       "end what holds the memory there (`ps aux --sort=-rss | head` on it), "
                       "or give the node fewer slots")
    return finding("memory", True, what)


def check_gpu_count(ctx: dict[str, Any]) -> dict[str, Any] | None:
    """Fewer GPUs than the node's slots, when the job uses GPUs there (the node has some, or the
    cluster file asks for NCCL). Not asked when the GPUs are chosen already (an explicit
    ``gpus:`` list, or ``CUDA_VISIBLE_DEVICES`` set by Slurm or the user)."""
    if ctx.get("chosen"):
        return None
    slots = max(1, int(ctx.get("slots") or 1))
    count = ctx["gpu_count"] if "gpu_count" in ctx else int(gpus().get("count") or 0)
    uses = count > 0 or ctx.get("backend") == BACKEND_NCCL
    if not uses:
        return None
    what = f"{count} GPU(s) for {slots} slot(s)"
    if count < slots:
        why = " with backend nccl" if count == 0 else ""
        return finding("gpus", False, f"fewer GPUs than slots: {what}{why}",
                        "see `nvidia-smi` and the kernel log on it (a GPU that fell off the bus "
                        "needs a reset or a reboot), or set slots: to its GPU count")
    return finding("gpus", True, what)


Check = Callable[[dict[str, Any]], "dict[str, Any] | None"]
CHECKS: list[Check] = [check_gpu_count, check_disk, check_memory]
"""The health gate, in order: each takes the context ``health`` is given (its facts may be given
there too: ``disk``, ``memory``, ``gpu_count``, for a test) and returns a finding or None (not
asked here). More checks (the GPU driver's Xids, ECC, row remapping) go at the end."""


def health(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """Every check's finding on this node. ``ctx``: ``workdir`` (this node's path), ``slots``,
    ``backend`` (the cluster file's), ``chosen`` (GPUs named already: not counted)."""
    out = []
    for check in CHECKS:
        found = check(ctx)
        if found is not None:
            out.append(found)
    return out


def unfit(findings: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The refusal the findings call for: every failed check's what and fix together; None when
    the node is fit."""
    bad = [f for f in findings if not f["ok"]]
    if not bad:
        return None
    return {"what": "; ".join(f["what"] for f in bad),
            "fix": "; ".join(f["fix"] for f in bad if f["fix"])}
