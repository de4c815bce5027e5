"""ptcluster: turn a few machines into a working PyTorch DDP cluster.

For programs run by ``ptcluster run``: ``ptcluster.checkpoint_saved(step)`` and
``ptcluster.resumed_from(step)`` tell the head about the job's progress (``--max-restarts``);
``ptcluster.checkpoint`` saves and loads checkpoints on the nodes' own disks.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["checkpoint_saved", "resumed_from"]


def __getattr__(name: str) -> Any:
    if name == "checkpoint":  # a subpackage, loaded on first use (it imports torch when used)
        import importlib

        return importlib.import_module("ptcluster.checkpoint")
    # Lazily: they live in the rank side's API, which imports torch; the CLI must not.
    if name in __all__:
        from ptcluster.node.rank import api

        return getattr(api, name)
    raise AttributeError(f"module 'ptcluster' has no attribute {name!r}")
