"""``save`` and ``wait``: a DCP checkpoint on every node's own disk, replicated to the next node.

Why our own staging and thread rather than ``dcp.async_save``: the save is more than DCP's write
(the hashes, the replication, the marker, the pruning), and all of it must run after the write
and in the same order on every rank; one background thread that does it all, on the
checkpoint's own gloo group, keeps every collective of the checkpoint in one sequence per rank.
Training blocks only for ``stage``: a copy of every tensor to host memory (what async_save's
default stager does too).
"""

from __future__ import annotations

import copy
import logging
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from ptcluster.checkpoint import layout
from ptcluster.checkpoint.place import Place, place
from ptcluster.checkpoint.transfer import Incoming, Outgoing, exchange

log = logging.getLogger(__name__)


def stage(obj: Any, into: Any = None) -> Any:
    """A copy of ``obj`` in host memory: tensors copied to the CPU, containers rebuilt,
    ``Stateful`` objects replaced by their ``state_dict()``, anything else deep-copied.

    ``into``: the last save's copy, whose tensors are reused where one has the same shape,
    dtype and layout (the last save is done with them: ``save`` waits for it first). Copying
    into memory already touched is what makes the copy cheap: a fresh 256 MiB buffer costs
    its page faults every time (DCP's async stager caches its buffers for the same reason)."""
    if isinstance(obj, torch.Tensor):
        old = into if isinstance(into, torch.Tensor) else None
        if old is not None and old.shape == obj.shape and old.dtype == obj.dtype and \
                old.layout == obj.layout == torch.strided and old.is_contiguous() and \
                type(obj) in (torch.Tensor, torch.nn.Parameter):
            return old.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Stateful):
        return stage(obj.state_dict(), into)
    if isinstance(obj, dict):
        was = into if isinstance(into, dict) else {}
        return {k: stage(v, was.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        prev = list(into) if isinstance(into, (list, tuple)) and len(into) == len(obj) else \
            [None] * len(obj)
        return type(obj)(stage(v, w) for v, w in zip(obj, prev, strict=True))
    return copy.deepcopy(obj)


class _Pending:
    """The save running in the background, if any, and what ended the last one."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_step: int | None = None
        """The newest step this process saw complete and replicated."""
        self.staged: dict[str, Any] = {}
        """The last save's host copy per checkpoint root: its buffers are reused by the next
        save there (held between saves: the price of a cheap copy, as DCP's caching stager)."""


PENDING = _Pending()


def wait() -> int | None:
    """Block until the last save is complete and replicated on every node; its step (None: no
    save yet). Raises what made the last save fail."""
    if PENDING.thread is not None:
        PENDING.thread.join()
        PENDING.thread = None
    if PENDING.error is not None:
        error, PENDING.error = PENDING.error, None
        raise RuntimeError(f"ptcluster.checkpoint: the last save failed: {error}") from error
    return PENDING.last_step


def save(state: dict[str, Any], step: int, dir: str = "ckpt", keep: int = 2) -> None:
    """Checkpoint ``state`` as of ``step``; returns once it is copied to host memory."""
    wait()
    where = place()
    root = layout.root_dir(dir)
    layout.check_owner(root)
    staged = stage(state, PENDING.staged.pop(str(root), None))
    PENDING.staged[str(root)] = staged
    save_id = where.gather(uuid.uuid4().hex)[0]  # rank 0's: the same on every rank
    PENDING.thread = threading.Thread(target=_background, name="ptcluster-checkpoint",
                                      args=(where, root, int(step), save_id, staged, keep),
                                      daemon=True)
    PENDING.thread.start()


def _background(where: Place, root: Path, step: int, save_id: str, staged: dict[str, Any],
                keep: int) -> None:
    try:
        _write(where, root, step, save_id, staged, keep)
    except BaseException as exc:  # kept for wait(): this thread has no caller to raise to
        log.error("checkpoint of step %d failed: %s", step, exc)
        PENDING.error = exc


def _write(where: Place, root: Path, step: int, save_id: str, staged: dict[str, Any],
           keep: int) -> None:
    folder = layout.step_dir(root, step)
    if where.leader:  # a step saved again (a restart that resumed before it) starts afresh
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    where.barrier()
    dcp.save(staged, storage_writer=dcp.FileSystemWriter(folder), process_group=where.group)
    part = None
    if where.leader:
        part = {name: [(folder / name).stat().st_size, layout.sha256_of(folder / name)]
                for name in layout.own_files(folder)}
    parts = {where.node_of[r]: p for r, p in enumerate(where.gather(part)) if p is not None}
    failed = None
    if where.leader and where.nodes > 1:
        failed = _replicate(where, root, step, parts)
    said = [f"node {where.node_of[r]}: {e}" for r, e in enumerate(where.gather(failed)) if e]
    if said:  # every rank knows, none writes a marker: the step stays unmarked everywhere
        raise OSError(f"step {step} not replicated ({'; '.join(said)})")
    manifest = layout.Manifest(step, save_id, parts)
    if where.leader:
        layout.write_atomic(folder / layout.MARKER, manifest.to_bytes())
    where.barrier()  # every node's marker is written
    PENDING.last_step = step
    if where.leader:
        _report(step, folder)
        gone = layout.prune(root, keep)
        if gone:
            log.debug("pruned steps %s under %s", gone, root)


def _replicate(where: Place, root: Path, step: int,
               parts: dict[int, dict[str, list]]) -> str | None:
    """This node's files to the next node's leader, the previous node's into
    ``replica-of-<prev>``, at once; what failed here (None: nothing)."""
    nxt, prev = (where.node + 1) % where.nodes, (where.node - 1) % where.nodes
    folder = layout.step_dir(root, step)
    mine = [Outgoing(folder / name, info[0]) for name, info in sorted(parts[where.node].items())]
    into = layout.replica_dir(root, step, prev)
    theirs = [Incoming(into / name, info[0], info[1])
              for name, info in sorted(parts[prev].items())]
    failed: str | None = None
    try:
        into.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # still take part: the sink fails too and drains, no peer blocks
        failed = f"{exc}"
    return exchange(where.group, where.leaders[nxt], mine, where.leaders[prev], theirs) \
        or failed


def _report(step: int, folder: Path) -> None:
    """Tell ptcluster's head (``checkpoint_saved``: a no-op outside ``ptcluster run``)."""
    try:
        from ptcluster.node.rank.api import checkpoint_saved
    except ImportError:  # pragma: no cover - the rank API ships with ptcluster
        return
    checkpoint_saved(step, folder)
