"""Per-node checkpoints in a folder on the node's own disk, and how nodes that lack one get it.

A checkpoint is taken at a *position*: ``(epoch, steps done in that epoch)``. At the end of an
epoch the file is ``checkpoint-<epoch>.pt``; between epochs (``--checkpoint-every-steps``) it is
``checkpoint-<epoch>-<step>.pt``. Local rank 0 of every node writes its node's copy (the copies
are identical: DDP keeps every rank's parameters and optimizer state in step), so losing one
node's disk loses nothing. On resume every rank reports the positions its node holds and all
take the newest one *any* node holds: ranks whose node has it read it from their disk, the
others receive its bytes over the process group from the first rank that has it (:func:`share`,
checked against the sender's sha256) and their node keeps a copy. The trainer does both through
:class:`Checkpoints` (what it saves: a :class:`TrainState`).

Why keeping the last two is enough: a node saves position ``p`` only after the collectives of
the step that reached ``p``, which every other rank enters only after saving the position before
it. So whenever any node has ``p``, every node has the position saved before ``p``: a crash in
the middle of a save leaves every node with a complete file.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn

from ptcluster.examples.mnist.world import World
from ptcluster.node.rank_wire import JOB_VAR

log = logging.getLogger("ptcluster.examples.mnist")

END = sys.maxsize
"""The step of an epoch-end position: after every step of the epoch, whatever their number."""
Position = tuple[int, int]
_NAME = re.compile(r"checkpoint-(\d+)(?:-(\d+))?\.pt")


def path_of(folder: Path, position: Position) -> Path:
    epoch, step = position
    return folder / (f"checkpoint-{epoch}.pt" if step == END else f"checkpoint-{epoch}-{step}.pt")


def positions_in(folder: Path) -> set[Position]:
    """The positions with a complete checkpoint in ``folder`` (temporary files do not count)."""
    if not folder.is_dir():
        return set()
    found = set()
    for p in folder.iterdir():
        if m := _NAME.fullmatch(p.name):
            found.add((int(m.group(1)), END if m.group(2) is None else int(m.group(2))))
    return found


def newest(per_rank: Iterable[Iterable[Position]]) -> Position | None:
    """The newest position in any rank's list; None when no rank has one."""
    return max((p for positions in per_rank for p in positions), default=None)


def save(folder: Path, position: Position, state: dict[str, Any],
         keep: Position | None = None) -> Path:
    """Write to a temporary file, fsync, rename: a crash leaves the previous files intact.

    Then drop every position but this one and ``keep`` (the one saved before it): also a
    previous run's newer files, which after a fresh start would otherwise look newer than this
    run's.
    """
    target = _write(folder, position, lambda f: torch.save(state, f))
    for old in positions_in(folder) - {position, keep}:
        path_of(folder, old).unlink(missing_ok=True)  # missing: another node got there first
    return target


def write(folder: Path, position: Position, blob: bytes) -> Path:
    """A checkpoint received from another node, written as :func:`save` writes (atomically);
    this node's older files stay until its next save."""
    return _write(folder, position, lambda f: f.write(blob))


def _write(folder: Path, position: Position, fill: Callable[[IO[bytes]], object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = path_of(folder, position)
    # A unique temporary name: nodes that share one folder (a shared workdir) write at once.
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=target.name + ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)  # never a partial file: the last good one stays
        cause = _os_error(exc)
        if cause is not None and not cause.filename:
            # torch wraps the OSError of a full disk in its own RuntimeError, and a file
            # object's error names no file: say which (the shim reports errno and file).
            raise OSError(cause.errno, cause.strerror or os.strerror(cause.errno or 0),
                          str(target)) from exc
        raise
    _fsync_dir(folder)  # the rename itself survives a power cut
    return target


def _os_error(exc: BaseException | None) -> OSError | None:
    """The first ``OSError`` with an errno in ``exc``'s chain."""
    for _ in range(8):
        if exc is None or isinstance(exc, OSError) and exc.errno:
            return exc if isinstance(exc, OSError) else None
        exc = exc.__cause__ or exc.__context__
    return None


def from_bytes(blob: bytes, device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(io.BytesIO(blob), map_location=device, weights_only=True)
    return state


@dataclass(frozen=True)
class Shared:
    """What :func:`share` did: the checkpoint's bytes on this rank, the rank that sent them to
    the ranks that needed them (-1: none did), their size, and the ranks whose own copy was
    not the sender's (they hold the file, but other bytes)."""

    blob: bytes
    sender: int
    size: int
    differed: list[int]


def share(folder: Path, position: Position, have: Sequence[bool], rank: int,
          device: torch.device) -> Shared:
    """The same bytes of ``position``'s checkpoint on every rank.

    ``have[r]``: rank ``r``'s node holds it (at least one does). Every rank that holds it reads
    its own disk and all compare sha256s; where they agree and every node holds it, nothing is
    sent. Otherwise the first rank that holds it broadcasts the bytes, and every rank that
    lacks it (or holds other bytes) takes them, checked against the sender's sha256. A
    collective when there is more than one rank: every rank calls it with the same ``have``.
    """
    mine = path_of(folder, position).read_bytes() if have[rank] else b""
    if len(have) == 1:
        return Shared(mine, -1, len(mine), [])
    digests: list[Any] = [None] * len(have)
    dist.all_gather_object(digests, hashlib.sha256(mine).hexdigest() if have[rank] else None)
    src = have.index(True)
    need = [d != digests[src] for d in digests]
    if not any(need):
        return Shared(mine, -1, len(mine), [])
    size = torch.tensor([len(mine) if rank == src else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if rank == src else \
        torch.empty(int(size.item()), dtype=torch.uint8)
    buf = buf.to(device)
    dist.broadcast(buf, src=src)
    differed = [r for r, (d, n) in enumerate(zip(digests, need, strict=True)) if d and n]
    if not need[rank]:
        return Shared(mine, src, len(buf), differed)
    got = buf.cpu().numpy().tobytes()
    if hashlib.sha256(got).hexdigest() != digests[src]:
        raise RuntimeError(f"{path_of(folder, position).name} from rank {src} arrived damaged "
                           f"(sha256 {hashlib.sha256(got).hexdigest()[:16]}, sent "
                           f"{digests[src][:16]})")
    return Shared(got, src, len(got), differed)


@dataclass(frozen=True)
class TrainState:
    """What a checkpoint holds besides the position and the RNG (the global generators): the
    model (not DDP's wrapper), its optimizer, and fp16's loss scaler (kept only when enabled:
    without it a resume starts the loss scale over)."""

    net: nn.Module
    opt: torch.optim.Optimizer
    scaler: Any


@dataclass(frozen=True)
class Start:
    """Where training starts: epoch, steps already done in it, the global batch, and the
    checkpoint position it came from (None: from the beginning)."""

    epoch: int
    step: int
    global_batch: int
    position: Position | None = None


class Checkpoints:
    """This run's checkpoints of ``state`` in ``folder`` on every node: :meth:`resume` from the
    newest any node has, :meth:`save` at a position (each keeps the one saved before)."""

    def __init__(self, folder: Path, state: TrainState, world: World, dataset: str) -> None:
        self.folder, self.state, self.world, self.dataset = folder, state, world, dataset
        self.last: Position | None = None
        """The position saved last (or resumed from): kept by the next save."""

    def resume(self, fresh: Start, *, restarted: bool) -> Start:
        """Where to start: after the newest checkpoint any node holds (none: ``fresh``).

        Each rank reports the positions on its node's disk and all pick the newest. Ranks whose
        node holds it read it from there; the others (and any whose copy is not the same bytes)
        receive it from the first rank that does (:func:`share`) and the first rank of each such
        disk writes its copy. A restart (``restarted``) takes only this job's own checkpoints.
        A collective: every rank must call it.
        """
        rank, folder = self.world.rank, self.folder
        disk = (socket.gethostname(), str(folder.resolve()))
        held = self.world.gather((disk, sorted(positions_in(folder))))
        position = newest(positions for _, positions in held)
        if position is None:
            log.info("resume: no node has a checkpoint in %s: starting fresh", folder)
            return fresh
        path = path_of(folder, position)
        have = [position in positions for _, positions in held]
        shared = share(folder, position, have, rank, self.world.device)
        state = from_bytes(shared.blob, self.world.device)
        if restarted and state.get("job_id", "") != os.environ.get(JOB_VAR, ""):
            log.info("restart: %s is not this job's: starting fresh", path)
            return fresh
        if state["dataset"] != self.dataset:
            raise ValueError(f"{path} was trained on {state['dataset']}, but this run loaded "
                             f"{self.dataset}: resume with the data it was trained on, or "
                             "start without --resume")
        disks = [d for d, _ in held]
        if (not have[rank] or rank in shared.differed) and disks.index(disk) == rank:
            write(folder, position, shared.blob)  # this disk's copy, by its first rank
        if shared.sender >= 0:
            _log_shared(path.name, shared, disks, have, rank)
        self._restore(state)
        self.last = position
        return _start_after(position, path, int(state.get("global_batch", fresh.global_batch)))

    def _restore(self, state: dict[str, Any]) -> None:
        device = self.world.device
        self.state.net.load_state_dict(state["model"])
        self.state.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"].cpu())
        if "cuda_rng" in state and device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), device)
        if state.get("scaler") and self.state.scaler.is_enabled():
            self.state.scaler.load_state_dict(state["scaler"])

    def save(self, position: Position, global_batch: int) -> bool:
        """Local rank 0 of every node saves (one copy per node: a node that loses its disk loses
        nothing); every rank remembers ``position`` as the last. Whether this rank saved."""
        mine = self.world.local_rank == 0
        if mine:
            save(self.folder, position, self._state_dict(position, global_batch),
                 keep=self.last)
        self.last = position
        return mine

    def _state_dict(self, position: Position, global_batch: int) -> dict[str, Any]:
        device = self.world.device
        state = {"model": self.state.net.state_dict(), "optimizer": self.state.opt.state_dict(),
                 "epoch": position[0], "step": position[1], "dataset": self.dataset,
                 "rng": torch.get_rng_state(), "global_batch": global_batch,
                 "world_size": self.world.size, "job_id": os.environ.get(JOB_VAR, "")}
        if device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(device)
        if self.state.scaler.is_enabled():  # fp16: without it a resume starts the loss scale over
            state["scaler"] = self.state.scaler.state_dict()
        return state


def _log_shared(name: str, shared: Shared, disks: list[tuple[str, str]], have: list[bool],
                rank: int) -> None:
    """Say where a resume's checkpoint came from and which copies it replaced."""
    def hosts(ranks: list[int]) -> str:
        return ", ".join(dict.fromkeys(disks[r][0] for r in ranks))

    lacking = [r for r in range(len(have)) if not have[r]]
    log.info("resume: %s came from %s (rank %d) to %s (%.1f MB, sha256 checked); each now "
             "holds a copy", name, disks[shared.sender][0], shared.sender,
             hosts(lacking + shared.differed), shared.size / 1e6)
    if shared.differed and rank == 0:
        log.warning("resume: the copy of %s on %s was not the same as %s's: replaced", name,
                    hosts(shared.differed), disks[shared.sender][0])


def _start_after(position: Position, path: Path, global_batch: int) -> Start:
    epoch, step = position
    if step == END:
        log.info("resumed from %s (the newest any node has): continuing at epoch %d", path,
                 epoch + 2)
        return Start(epoch + 1, 0, global_batch, position)
    log.info("resumed from %s (the newest any node has): continuing in epoch %d after step "
             "%d", path, epoch + 1, step)
    return Start(epoch, step, global_batch, position)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
