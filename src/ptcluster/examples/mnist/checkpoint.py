"""Per-node checkpoints in a folder on the node's own disk, and how nodes that lack one get it.

A checkpoint is taken at a *position*: ``(epoch, steps done in that epoch)``. At the end of an
epoch the file is ``checkpoint-<epoch>.pt``; between epochs (``--checkpoint-every-steps``) it is
``checkpoint-<epoch>-<step>.pt``. Local rank 0 of every node writes its node's copy (the copies
are identical: DDP keeps every rank's parameters and optimizer state in step), so losing one
node's disk loses nothing. On resume every rank reports the positions its node holds and all
take the newest one *any* node holds: ranks whose node has it read it from their disk, the
others receive its bytes over the process group from the first rank that has it (:func:`share`,
checked against the sender's sha256) and their node keeps a copy.

Why keeping the last two is enough: a node saves position ``p`` only after the collectives of
the step that reached ``p``, which every other rank enters only after saving the position before
it. So whenever any node has ``p``, every node has the position saved before ``p``: a crash in
the middle of a save leaves every node with a complete file.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

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


def epochs_in(folder: Path) -> set[int]:
    """The epochs with a complete end-of-epoch checkpoint in ``folder``."""
    return {epoch for epoch, step in positions_in(folder) if step == END}


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
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(folder)  # the rename itself survives a power cut
    return target


def load(folder: Path, position: Position, device: torch.device) -> dict[str, Any]:
    return from_bytes(path_of(folder, position).read_bytes(), device)


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


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
