"""Which GPUs of this node a job's ranks use (``gpus:`` in the cluster file), leased for the job.

Standard library only; a part of the guard. ``gpus:`` is absent (auto where the node has GPUs,
nothing on a node without), ``auto`` (the first ``slots`` free ones: not leased by another
ptcluster job, and with no compute process on them per NVML), or a list of indices. Each chosen
GPU is leased (``leases.py``) for the job's life and the ranks see only those
(``CUDA_VISIBLE_DEVICES``), so ``LOCAL_RANK`` -> ``cuda:LOCAL_RANK`` keeps working. On a node
without GPUs an explicit ``gpus:`` still leases its indices (a CPU testbed shares them the same
way) and NVML's part is skipped, and said so.
"""

from __future__ import annotations

import os
import pwd
from typing import Any

from ptcluster.node.facts.accel import compute_processes, gpus
from ptcluster.node.guard.refusal import GPU_NOT_THERE, GPUS_BUSY, GuardError, refuse, unleasable
from ptcluster.node.sharing.leases import Lease, Leasing, describe
from ptcluster.node.wire import GpuClaim, LeaseOwner

VIRTUAL_GPUS = 1024
"""How far ``auto`` looks on a node without GPUs (indices only: nothing there to run out of)."""


def spans(indices: list[int]) -> str:
    """``0-3,6``: indices as a person writes them."""
    out: list[str] = []
    for i in sorted(indices):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = out[-1].split("-")[0] + f"-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def _owner_of(pid: int) -> str:
    try:
        return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError):
        return "?"


def _gpu_memory(mib: int) -> str:
    return f"{mib / 1024:.0f} GiB" if mib >= 1024 else f"{mib} MiB"


def claim(want: list[int] | str | None, slots: int, owner: LeaseOwner,
          env: dict[str, str], leasing: Leasing | None = None
          ) -> tuple[GpuClaim, list[Lease]]:
    """(what to report and set, the leases to hold): ``{"indices", "visible", "why"}``, and
    what ``why`` says as values: ``by`` (``preset``: CUDA_VISIBLE_DEVICES was set, nothing
    leased; ``listed``: the cluster file's ``gpus:``; ``auto``), ``skipped`` (auto: the GPUs
    passed over, as spans, -> who holds them), ``nvml`` (whether NVML's compute processes were
    read) and ``leased`` (false with ``run --no-leases``).

    Refused (``GuardError``, ``busy`` set) before any rank starts when the GPUs asked for are
    taken, naming who has them.
    """
    if "CUDA_VISIBLE_DEVICES" in env:  # Slurm's allocation, or the user's own choice
        return {"visible": env["CUDA_VISIBLE_DEVICES"], "by": "preset", "leased": False,
                "why": "CUDA_VISIBLE_DEVICES was already set (by Slurm or the cluster file's "
                       "env): not leased"}, []
    leasing = leasing or Leasing()
    count = int(gpus().get("count") or 0)
    if want is None and count == 0:
        return {}, []  # a CPU node, nothing asked: nothing to share
    processes, unchecked = compute_processes() if count else ({}, "no NVIDIA GPU: NVML skipped")
    candidates, need = _candidates(want, slots, count)
    chosen, held, taken, users = _take(candidates, need, processes, owner, leasing)
    if len(chosen) < need:
        for lease in held:
            lease.release()
        raise _refusal(need, len(chosen), taken, users, count)
    skipped = {} if isinstance(want, list) else {spans(ix): who for who, ix in taken.items()}
    if isinstance(want, list):
        why = "gpus: from the cluster file"
    else:
        said = "; ".join(f"{ix}: {who}" for ix, who in skipped.items())
        why = f"auto: the first {need} free" + (f" (skipped {said})" if said else "")
    if unchecked:
        why += f"; {unchecked}"
    if leasing.off:
        why += f"; not leased ({leasing.off}): other jobs are not kept off them"
    return {"indices": chosen, "visible": ",".join(map(str, chosen)), "why": why,
            "by": "listed" if isinstance(want, list) else "auto", "skipped": skipped,
            "nvml": not unchecked, "leased": not leasing.off}, held


def _candidates(want: list[int] | str | None, slots: int, count: int) -> tuple[list[int], int]:
    """(the GPUs to try, in order; how many the job needs): pure. A list names its GPUs (each
    must exist here); ``auto`` or nothing tries every GPU (every index, on a node without)."""
    pool = list(range(count or VIRTUAL_GPUS))
    if not isinstance(want, list):
        return pool, slots
    missing = [i for i in want if i not in pool]
    if missing:
        raise refuse(GPU_NOT_THERE, want=want, missing=spans(missing), count=count,
                     have=spans(pool) or "none")
    return list(want), len(want)


def _take(candidates: list[int], need: int, processes: dict[int, list[dict[str, int]]],
          owner: LeaseOwner, leasing: Leasing
          ) -> tuple[list[int], list[Lease], dict[str, list[int]], set[str]]:
    """Lease the first ``need`` free GPUs of ``candidates``: (those chosen, their leases, who
    holds each GPU skipped -> its indices, the users to ask). Released again on an OSError."""
    chosen: list[int] = []
    held: list[Lease] = []
    holders: dict[str, dict[str, Any]] = {}  # who -> {"record", "gpus": of those asked, "mib"}
    users: set[str] = set()
    try:
        for i in candidates:
            if len(chosen) == need:
                break
            procs = processes.get(i) or []
            # The lease first: another ptcluster job's ranks are NVML compute processes too,
            # and that job is named by its lease (with the memory its processes use), not by
            # pid. Only processes on a GPU nobody has leased are outside ptcluster.
            lease = leasing.take(f"gpu-{i}", owner)
            if lease is None:
                record = leasing.holder(f"gpu-{i}") or {}
                if record.get("user"):
                    users.add(str(record["user"]))
                key = f"job {record['job_id']}" if record.get("job_id") else describe(record)
                entry = holders.setdefault(key, {"record": record, "gpus": [], "mib": 0})
                entry["gpus"].append(i)
                entry["mib"] += sum(int(p["mib"]) for p in procs)
                continue
            if procs:
                lease.release()
                for p in procs:
                    user = _owner_of(p["pid"])
                    users.add(user)
                    holders.setdefault(f"pid {p['pid']} ({user}, {_gpu_memory(p['mib'])})",
                                       {"gpus": []})["gpus"].append(i)
                continue
            held.append(lease)
            chosen.append(i)
    except OSError as exc:
        for lease in held:
            lease.release()
        raise unleasable("GPUs ", exc) from None
    taken = {(who if "record" not in entry else
              describe(entry["record"], _gpu_memory(entry["mib"]) if entry["mib"] else None)):
             entry["gpus"] for who, entry in holders.items()}
    return chosen, held, taken, users


def _refusal(need: int, free: int, taken: dict[str, list[int]], users: set[str],
             count: int) -> GuardError:
    """The refusal when fewer than ``need`` GPUs are free: pure. Who holds which, and what to
    do: wait, other GPUs that are free (``count`` of them here), or whom to ask."""
    what = "; ".join(f"GPU{'s' if len(ix) > 1 else ''} {spans(ix)} "
                     f"{'are' if len(ix) > 1 else 'is'} in use by {who}"
                     for who, ix in taken.items())
    left = [i for i in range(count) if i not in {j for ix in taken.values() for j in ix}]
    other = f", choose other GPUs (gpus: [{', '.join(map(str, left[:need]))}])" \
        if count and len(left) >= need else ""
    ask = f", or ask {', '.join(sorted(users))}" if users else ""
    return refuse(GPUS_BUSY, busy=True, need=need, free=free, held=what, other=other, ask=ask)
