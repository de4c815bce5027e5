"""The rank side's API: what a rank program calls (``ptcluster.resumed_from``,
``checkpoint_saved``, ``end_rank``; the reference trainer) and the set-up shared by the programs
ptcluster ships to ranks as ``-c`` code (the doctor's all-reduce, the bench worker: shipped with
this module and ``node.rank_wire``, so a node needs only torch, not ptcluster). Stdlib + torch.
"""

import logging
import os
import socket
import sys
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from ptcluster.node.rank_wire import (
    BACKEND_VAR,
    CHECKPOINT,
    DATA,
    REPORT,
    RESUMED,
    SOCK_VAR,
    connect,
    encode_record,
)


def init_distributed(timeout_s: float) -> tuple:
    """init_process_group with the backend ptcluster chose -> (rank, world, device, backend).

    ``BACKEND_VAR`` auto: NCCL when this rank has a GPU, else gloo. The device comes from
    LOCAL_RANK, never from the global rank.
    """
    backend = os.environ.get(BACKEND_VAR, "auto")
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


class _Records:
    """The rank's one connection to its guard for records, opened on first use. A lock: two
    threads of a rank (a data loader's, a checkpoint writer's) open one connection, and their
    records never interleave."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def send(self, kind: str, data: Mapping[str, object]) -> None:
        with self._lock:
            if self._sock is None:
                self._sock = connect(os.environ[SOCK_VAR], int(os.environ["RANK"]), DATA)
            self._sock.sendall(encode_record(REPORT, {"kind": kind, **data}))


_RECORDS = _Records()


def report(kind: str, data: Mapping[str, object]) -> None:
    """Send a structured record to the head (``Runner.on_data``), on the guard's socket.

    Never mixed with the rank's output, so nothing a program prints can pass for a record.
    """
    _RECORDS.send(kind, data)


def checkpoint_saved(step: int, path: str | os.PathLike[str] | None = None) -> None:
    """Tell ptcluster that a checkpoint of ``step`` is complete on this node (``path``: its
    folder or file, where the next attempt's health gate checks the disk).

    ``run --max-restarts`` uses it for its no-progress rule: a restarted attempt that saves
    nothing newer than the step it resumed from ends the job (exit 3) instead of failing the
    same way again; with ``path``, a restart refuses a node whose checkpoint disk is nearly
    full (as its workdir's). A no-op outside ``ptcluster run``.
    """
    if SOCK_VAR in os.environ:
        data: dict[str, object] = {"step": int(step)}
        if path is not None:
            data["path"] = os.path.abspath(os.fspath(path))
        report(CHECKPOINT, data)


def resumed_from(step: int) -> None:
    """Tell ptcluster the step this attempt starts from (0: from the beginning). Shown per
    attempt in the summary; with ``checkpoint_saved`` it makes the no-progress rule apply."""
    if SOCK_VAR in os.environ:
        report(RESUMED, {"step": int(step)})


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
