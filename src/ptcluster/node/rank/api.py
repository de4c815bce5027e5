"""Per-rank set-up shared by the programs ptcluster ships to ranks as ``-c`` code (the doctor's
all-reduce, the bench worker): they are prefixed with this file's source, so a node needs only
torch, not ptcluster. Stdlib + torch only.
"""

import json
import logging
import os
import socket
import sys
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float) -> tuple:
    """init_process_group with the backend ptcluster chose -> (rank, world, device, backend).

    PTCLUSTER_BACKEND=auto: NCCL when this rank has a GPU, else gloo. The device comes from
    LOCAL_RANK, never from the global rank.
    """
    backend = os.environ.get("PTCLUSTER_BACKEND", "auto")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device, backend


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


_REPORT: list = []


def report(kind: str, data: dict) -> None:
    """Send a structured record to the head (``Runner.on_data``), on the guard's socket.

    Never mixed with the rank's output, so nothing a program prints can pass for a record.
    """
    if not _REPORT:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(os.environ["PTCLUSTER_GUARD_SOCK"])
        s.sendall(json.dumps({"rank": int(os.environ["RANK"]), "role": "data"}).encode() + b"\n")
        _REPORT.append(s)
    body = json.dumps({"kind": kind, **data})
    _REPORT[0].sendall(b"data " + body.encode() + b"\n")


def checkpoint_saved(step: int) -> None:
    """Tell ptcluster that a checkpoint of ``step`` is complete on this node.

    ``run --max-restarts`` uses it for its no-progress rule: a restarted attempt that saves
    nothing newer than the step it resumed from ends the job (exit 3) instead of failing the
    same way again. A no-op outside ``ptcluster run``.
    """
    if "PTCLUSTER_GUARD_SOCK" in os.environ:
        report("checkpoint", {"step": int(step)})


def resumed_from(step: int) -> None:
    """Tell ptcluster the step this attempt starts from (0: from the beginning). Shown per
    attempt in the summary; with ``checkpoint_saved`` it makes the no-progress rule apply."""
    if "PTCLUSTER_GUARD_SOCK" in os.environ:
        report("resumed", {"step": int(step)})


def end_rank(code: int) -> NoReturn:
    """End a rank whose work is done and whose process group is destroyed, without the
    interpreter's teardown: with gloo that teardown can abort a finished process (SIGABRT,
    "terminate called without an active exception": gloo work objects holding tensors freed
    during finalization, pytorch PR 179291), and a launcher would report the rank as failed.
    Seen here in about 1 of 10 two-rank trainer runs. Outside a launcher: a plain exit."""
    if "RANK" not in os.environ:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # its reader is gone: nothing left to say it to
            pass
    os._exit(code)
