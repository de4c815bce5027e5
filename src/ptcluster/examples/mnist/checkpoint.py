"""Per-node checkpoints: ``checkpoint-<epoch>.pt`` files in a folder on the node's own disk.

Local rank 0 of every node writes its node's copy (the copies are identical: DDP keeps every
rank's parameters and optimizer state in step), so losing one node's disk loses nothing. On
resume every rank reports the epochs its node holds and all take the newest one every node has.

Why keeping the last two is enough: a node saves epoch ``e`` only after the collectives of
epoch ``e`` (gradient all-reduces, the loss and accuracy sums), which every other rank enters
only after saving ``e - 1``. So whenever any node has ``e``, every node has ``e - 1``.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

KEEP = 2
_NAME = re.compile(r"checkpoint-(\d+)\.pt")


def path_of(folder: Path, epoch: int) -> Path:
    return folder / f"checkpoint-{epoch}.pt"


def epochs_in(folder: Path) -> set[int]:
    """The epochs with a complete checkpoint in ``folder`` (temporary files do not count)."""
    if not folder.is_dir():
        return set()
    return {int(m.group(1)) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))}


def agreed_epoch(per_rank: Sequence[Iterable[int]]) -> int | None:
    """The newest epoch in every rank's list; None when they have none in common."""
    common = set.intersection(*(set(epochs) for epochs in per_rank)) if per_rank else set()
    return max(common, default=None)


def save(folder: Path, epoch: int, state: dict[str, Any]) -> Path:
    """Write to a temporary file, fsync, rename: a crash leaves the previous files intact.

    Then drop every epoch but the last ``KEEP`` (also a previous run's newer files: with a
    fresh start they would otherwise look newer than this run's).
    """
    folder.mkdir(parents=True, exist_ok=True)
    target = path_of(folder, epoch)
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
    for old in epochs_in(folder) - set(range(epoch - KEEP + 1, epoch + 1)):
        path_of(folder, old).unlink(missing_ok=True)  # missing: another node got there first
    return target


def load(folder: Path, epoch: int, device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path_of(folder, epoch), map_location=device,
                                       weights_only=True)
    return state


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
