"""Checkpoints on the nodes' own disks, for any script: ``save``, ``load``, ``wait``.

``save(state, step)`` writes a ``torch.distributed.checkpoint`` (DCP) checkpoint of ``state``
(what DCP takes: a dict of tensors, state dicts or ``Stateful`` objects) under ``dir`` on each
node's own disk, in the background (training blocks only for the copy to host memory); then each
node's files are replicated to the next node, and a marker on every node says the step is
complete. ``load(state)`` finds the newest step complete somewhere in the job, reads each file
from a node that holds it (its own copy or a replica), restores ``state`` in place in any world
size, and returns the step (None when there is none). Every rank calls both, together.

``dir`` is relative to the workdir (a rank's working directory), or to ``$PTCLUSTER_CKPT_ROOT``
when set. torch is imported on first use, so ``import ptcluster`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["last_saved", "load", "save", "wait"]


def save(state: dict[str, Any], step: int, dir: str = "ckpt", keep: int = 2) -> None:
    """Checkpoint ``state`` as of ``step`` under ``dir`` on every node; keep the ``keep``
    newest complete steps there. Returns once ``state`` is copied to host memory; the write,
    the replication and the marker run in the background (call ``wait()`` before exiting).
    A collective: every rank calls it with the same ``step``."""
    from ptcluster.checkpoint import saver

    saver.save(state, step, dir, keep)


def wait() -> int | None:
    """Block until the last save is complete and replicated on every node; its step."""
    from ptcluster.checkpoint import saver

    return saver.wait()


def load(state: dict[str, Any], dir: str = "ckpt", step: int | None = None) -> int | None:
    """Restore ``state`` in place from the newest complete checkpoint (or ``step``) under
    ``dir`` on the job's nodes and return its step; None (logged why) when there is none.
    A collective: every rank calls it."""
    from ptcluster.checkpoint import loader

    return loader.load(state, dir, step)


def last_saved() -> int | None:
    """The newest step this process saw complete and replicated (also reported to the head
    with ``ptcluster.checkpoint_saved``); None before any."""
    from ptcluster.checkpoint import saver

    return saver.PENDING.last_step
