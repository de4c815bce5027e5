"""The sweep as PNGs, the way nccl-tests users read it: bus bandwidth and time per op against
message size (labelled 8 B, 1 KiB, 1 MiB: powers of 1024 on a log axis), one line per op; and
the node-pair bandwidth matrix as a heatmap in a PNG of its own.

matplotlib is the optional ``plot`` extra. Figures are made with ``matplotlib.figure.Figure``
and saved with the Agg renderer; pyplot (and its global backend) is never touched.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ptcluster.bench.sweep import BenchResult
from ptcluster.errors import UsageError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
MAX_SIZE_TICKS = 14
"""Most labelled sizes on the x axis (10 in wide): more would overlap."""
MAX_TIME_TICKS = 9
"""Most labelled times on a panel's y axis (4 in high)."""


def size_label(nbytes: float) -> str:
    """Bytes as people write them: 8 -> "8 B", 1024 -> "1 KiB", 3 << 20 -> "3 MiB",
    1536 -> "1.5 KiB" (powers of 1024, at most two decimals)."""
    value, unit = float(nbytes), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} {_UNITS[unit]}"


def size_ticks(lo: int, hi: int, most: int = MAX_SIZE_TICKS) -> list[int]:
    """Powers of two between ``lo`` and ``hi`` bytes to label: every exponent, or every 2nd,
    5th or 10th (so 1 KiB, 1 MiB and 1 GiB stay among them), the first step giving at most
    ``most``; ``[lo]`` when no power of two lies in between."""
    first, last = math.ceil(math.log2(lo)), math.floor(math.log2(hi))
    ticks: list[int] = []
    for step in (1, 2, 5, 10, 20):
        ticks = [1 << e for e in range(first, last + 1) if e % step == 0]
        if len(ticks) <= most:
            break
    return ticks or [lo]


def time_ticks(lo: float, hi: float, most: int = MAX_TIME_TICKS) -> list[float]:
    """Round values to label a log axis from lo to hi: 1-2-5 steps, or only powers of ten when
    those are too many, or every digit when the range is too narrow for two."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    ticks: list[float] = []
    for mults in ((1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9), (1,)):
        ticks = [m * 10.0**e for e in range(first, last + 1) for m in mults
                 if lo <= m * 10.0**e <= hi]
        if mults == (1, 2, 5) and len(ticks) < 2:
            continue  # too narrow: try every digit
        if len(ticks) <= most:
            break
    return ticks


def number_label(value: float) -> str:
    """1500 -> "1,500", 0.5 -> "0.5": plain numbers, never 1e+04."""
    return f"{value:,.0f}" if value >= 1 else f"{value:g}"


def pairs_path(path: str | Path) -> Path:
    """Where the node-pair heatmap goes: F.png -> F-pairs.png, next to the sweep's PNG."""
    path = Path(path)
    return path.with_name(f"{path.stem}-pairs{path.suffix or '.png'}")


def write_plots(result: BenchResult, path: str | Path) -> list[Path]:
    """The sweep's PNG at ``path`` (when there are rows) and the node-pair heatmap at
    ``pairs_path(path)`` (when there are pairs); returns the files written."""
    written: list[Path] = []
    if result.rows:
        save(plot_sweep(result), Path(path))
        written.append(Path(path))
    if result.pairs:
        save(plot_pairs(result), pairs_path(path))
        written.append(pairs_path(path))
    return written


def plot_sweep(result: BenchResult) -> Figure:
    """Two panels over one message-size axis: busbw (GB/s) above, time per op (µs, log) below;
    one line per op, the same colour in both."""
    figure_cls = _figure_class()
    fig = figure_cls(figsize=(10, 8), dpi=100, layout="constrained")
    bw_ax, time_ax = fig.subplots(2, 1, sharex=True)
    ops = list(dict.fromkeys(r.op for r in result.rows))
    for op in ops:
        rows = [r for r in result.rows if r.op == op]
        sizes = [r.size for r in rows]
        bw_ax.plot(sizes, [r.busbw for r in rows], marker="o", markersize=4, label=op)
        time_ax.plot(sizes, [r.time_us for r in rows], marker="o", markersize=4, label=op)
    lo, hi = min(r.size for r in result.rows), max(r.size for r in result.rows)
    _size_axis(time_ax, lo, hi)  # shared: the upper panel gets the same ticks, unlabelled
    for ax in (bw_ax, time_ax):
        ax.grid(True, which="major", alpha=0.35)
    bw_ax.legend(loc="upper left", title="op (both panels)", fontsize=9, title_fontsize=9)
    bw_ax.set_ylim(bottom=0)
    bw_ax.set_ylabel("bus bandwidth (GB/s)")
    bw_ax.set_title("Bus bandwidth (busbw)")
    _time_axis(time_ax, [r.time_us for r in result.rows])
    time_ax.set_ylabel("time per op (µs, log scale)")
    time_ax.set_title("Time per op")
    time_ax.grid(True, which="minor", axis="y", alpha=0.15)
    dtype = result.rows[0].type
    fig.suptitle(f"ptcluster bench: {result.world_size} ranks, {result.backend or '?'}, "
                 f"{dtype}", fontsize=13)
    return fig


def plot_pairs(result: BenchResult) -> Figure:
    """Node-pair bandwidth matrix: hosts on both axes, GB/s written in every cell."""
    hosts = list(dict.fromkeys([p["a"] for p in result.pairs] + [p["b"] for p in result.pairs]))
    k = len(hosts)
    index = {h: i for i, h in enumerate(hosts)}
    grid = [[math.nan] * k for _ in hosts]
    for p in result.pairs:
        a, b = index[p["a"]], index[p["b"]]
        grid[a][b] = grid[b][a] = p["gbps"]
    top = max(p["gbps"] for p in result.pairs) or 1.0
    figure_cls = _figure_class()
    side = max(4.5, 0.9 * k + 2.5)
    fig = figure_cls(figsize=(side + 1.2, side), dpi=100, layout="constrained")
    ax = fig.subplots()
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#e8e8e8")
    image = ax.imshow(grid, cmap=cmap, vmin=0, vmax=top)
    for i in range(k):
        for j in range(k):
            value = grid[i][j]
            if math.isnan(value):
                ax.text(j, i, "–", ha="center", va="center", color="#808080")
            else:  # light text on viridis' dark low end, dark text on its light high end
                ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=10,
                        color="white" if value < 0.6 * top else "black")
    long_names = max(len(h) for h in hosts) > 6
    ax.set_xticks(range(k), hosts, rotation=30 if long_names else 0,
                  ha="right" if long_names else "center")
    ax.set_yticks(range(k), hosts)
    fig.colorbar(image, ax=ax, label="GB/s", shrink=0.85)
    size = size_label(result.pairs[0]["bytes"])
    ax.set_title(f"Node-pair bandwidth (GB/s), sendrecv ping-pong of {size}\n"
                 f"ptcluster bench: {result.world_size} ranks, {result.backend or '?'}",
                 fontsize=11)
    return fig


def save(fig: Figure, path: Path) -> None:
    fig.savefig(path, format="png")


def _size_axis(ax: Axes, lo: int, hi: int) -> None:
    """Log-2 x axis from lo to hi bytes with human size labels that do not overlap."""
    from matplotlib.ticker import FixedLocator, NullFormatter

    ax.set_xscale("log", base=2)
    ticks = size_ticks(lo, hi)
    ax.set_xticks(ticks, [size_label(t) for t in ticks])
    minor = [1 << e for e in range(math.ceil(math.log2(lo)), math.floor(math.log2(hi)) + 1)]
    ax.xaxis.set_minor_locator(FixedLocator(minor))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo / 1.3, hi * 1.3)
    ax.set_xlabel("message size")


def _time_axis(ax: Axes, times: list[float]) -> None:
    """Log y axis around the times, labelled with plain numbers (µs)."""
    from matplotlib.ticker import NullFormatter

    positive = [t for t in times if t > 0] or [1.0]
    lo, hi = min(positive) / 1.3, max(positive) * 1.3
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ticks = time_ticks(lo, hi)
    ax.set_yticks(ticks, [number_label(t) for t in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())


def _figure_class() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("--plot needs matplotlib", "pip install 'ptcluster[plot]'") from None
    return Figure
