"""ptcluster: turn a few machines into a working PyTorch DDP cluster."""

from __future__ import annotations

__version__ = "0.1.0"
