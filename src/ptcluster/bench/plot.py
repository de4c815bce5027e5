"""busbw against message size (log x), one line per op, as a PNG (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from ptcluster.bench.sweep import BenchResult
from ptcluster.errors import UsageError


def plot_busbw(result: BenchResult, path: str | Path, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib", "pip install 'ptcluster[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for op in dict.fromkeys(r.op for r in result.rows):
        rows = [r for r in result.rows if r.op == op]
        ax.plot([r.size for r in rows], [r.busbw for r in rows], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title or f"ptcluster bench: {result.world_size} ranks, {result.backend}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
