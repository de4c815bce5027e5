"""Per-node checkpoints in a folder on the node's own disk.

A checkpoint is taken at a *position*: ``(epoch, steps done in that epoch)``. At the end of an
epoch the file is ``checkpoint-<epoch>.pt``; between epochs (``--checkpoint-every-steps``) it is
``checkpoint-<epoch>-<step>.pt``. Local rank 0 of every node writes its node's copy (the copies
are identical: DDP keeps every rank's parameters and optimizer state in step), so losing one
node's disk loses nothing. On resume every rank reports the positions its node holds and all
take the newest one every node has.

Why keeping the last two is enough: a node saves position ``p`` only after the collectives of
the step that reached ``p``, which every other rank enters only after saving the position before
it. So whenever any node has ``p``, every node has the position saved before ``p``.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

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


def agreed(per_rank: Sequence[Iterable[Position]]) -> Position | None:
    """The newest position in every rank's list; None when they have none in common."""
    common = set.intersection(*(set(p) for p in per_rank)) if per_rank else set()
    return max(common, default=None)


def save(folder: Path, position: Position, state: dict[str, Any],
         keep: Position | None = None) -> Path:
    """Write to a temporary file, fsync, rename: a crash leaves the previous files intact.

    Then drop every position but this one and ``keep`` (the one saved before it): also a
    previous run's newer files, which after a fresh start would otherwise look newer than this
    run's.
    """
    folder.mkdir(parents=True, exist_ok=True)
    target = path_of(folder, position)
    # A unique temporary name: nodes that share one folder (a shared workdir) write at once.
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=target.name + ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(folder)  # the rename itself survives a power cut
    for old in positions_in(folder) - {position, keep}:
        path_of(folder, old).unlink(missing_ok=True)  # missing: another node got there first
    return target


def load(folder: Path, position: Position, device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path_of(folder, position), map_location=device,
                                       weights_only=True)
    return state


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
