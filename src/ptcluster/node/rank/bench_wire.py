"""``ptcluster bench``'s boundary: what the head gives every rank's worker, and the records
rank 0 reports back.

Standard library only: the head imports it (``bench.sweep``) without torch; shipped with the
worker (``node.rank.bench_worker``).
"""

from __future__ import annotations

from typing import TypedDict


class WorkerConfig(TypedDict):
    """Every rank's worker's config (JSON, ``argv[1]``; ``bench.sweep.worker_config`` writes
    it): counts, not sizes, so that the head's formulas are the only ones."""

    plan: list[tuple[str, list[int]]]
    """Per op, the element counts to run (``bench.sweep.sweep_plan``)."""
    iters: int
    warmup: int
    min_s: float
    """Seconds each count is timed for at least (0: ``iters`` only)."""
    check: int
    """Verified runs per count."""
    dtype: str
    """A torch dtype's name (``float32``)."""
    timeout: float
    """The process group's timeout (s)."""
    corrupt: bool
    """Test-only: rank 0 perturbs one expected value per check."""
    pairs: list[list[int]]
    """``[rank a, rank b]``: the ping-pongs between nodes (none: no pair matrix)."""
    pair_count: int
    """Elements per ping-pong message."""


class Started(TypedDict):
    """``start`` (rank 0, once): the job as the worker sees it."""

    world_size: int
    backend: str
    device: str


class RowDone(TypedDict):
    """``row``: one count of one op, timed and checked."""

    op: str
    count: int
    seconds: float
    """Per op, averaged over the ranks."""
    wrong: int
    """Wrong elements, summed over the ranks and checks."""


class PairDone(TypedDict):
    """``pair``: one ping-pong between two nodes' first ranks."""

    a: int
    b: int
    seconds: float
    """Per round trip."""
