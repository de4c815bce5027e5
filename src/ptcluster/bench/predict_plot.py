"""``bench --predict --plot FILE``: predicted step time and scaling efficiency per node count, two
panels over one node-count axis (the ``plot`` extra; Agg only, as ``bench.plot``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ptcluster.bench.plot import _figure_class, save
from ptcluster.bench.predict import Row

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_prediction(rows: Sequence[Row], title: str) -> Figure:
    """Step time (s) above, efficiency (%) below, a point per node count, coloured by bound."""
    fig = _figure_class()(figsize=(8, 7), dpi=100, layout="constrained")
    step_ax, eff_ax = fig.subplots(2, 1, sharex=True)
    nodes = [r.nodes for r in rows]
    step_ax.plot(nodes, [r.step_s for r in rows], color="#4c72b0", marker="o")
    eff_ax.plot(nodes, [100 * r.efficiency for r in rows], color="#4c72b0", marker="o")
    for bound, color in (("network", "#c44e52"), ("compute", "#55a868")):
        mine = [r for r in rows if r.bound == bound]
        step_ax.scatter([r.nodes for r in mine], [r.step_s for r in mine], color=color,
                        zorder=3, label=f"{bound}-bound")
        eff_ax.scatter([r.nodes for r in mine], [100 * r.efficiency for r in mine],
                       color=color, zorder=3)
    step_ax.set_ylim(bottom=0)
    step_ax.set_ylabel("predicted step time (s)")
    step_ax.set_title("Step time per rank")
    step_ax.legend(loc="upper left", fontsize=9)
    eff_ax.axhline(100, color="#808080", linewidth=0.8, linestyle="--")
    eff_ax.set_ylim(0, max(105, max(100 * r.efficiency for r in rows) + 5))
    eff_ax.set_ylabel("scaling efficiency (%)")
    eff_ax.set_title("Samples/s per rank against one node")
    eff_ax.set_xticks(nodes, [f"{r.nodes}\n({r.ranks} rank{'s' if r.ranks > 1 else ''})"
                              for r in rows])
    eff_ax.set_xlabel("nodes")
    for ax in (step_ax, eff_ax):
        ax.grid(True, alpha=0.35)
    fig.suptitle(title, fontsize=12)
    return fig


def write_prediction_plot(rows: Sequence[Row], path: str | Path, title: str) -> Path:
    save(plot_prediction(rows, title), Path(path))
    return Path(path)
