"""The slow node before the job: the same fixed compute probe timed on every rank at once
(``node/rank/allreduce.py``: matmuls on the rank's GPU, else its CPU), compared across nodes.

A node's figure is its slowest rank's (every rank of a job waits for the slowest at each
collective). A node more than ``SLOW_NODE`` times slower than the median of the *other* nodes is a
warning that names it, with both figures; the median of the others, so that one slow node of
two is still seen. Pure: the rank program measures, this judges.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

from ptcluster.cluster.model import ClusterSpec
from ptcluster.doctor.findings import OK, SLOW, Finding

SLOW_NODE = 1.8
"""A node this many times slower than the others' median is named. Measured on the 3-node
testbed, 2+1+1 ranks on 2 cores (``benchmarks/doctor_slow_node.py --repeat 4``): balanced runs
up to 1.44x (1.19, 1.16, 1.37, 1.44), a node capped to 25 % of a CPU at least 2.32x (3.03, 2.32,
2.92, 2.74): 1.8 sits between with room on both sides."""


def node_times(spec: ClusterSpec, per_rank: Sequence[float]) -> dict[str, float]:
    """Each node's figure: the slowest of its ranks' probe times."""
    return {node.host: max(per_rank[r] for r in spec.ranks_of(i))
            for i, node in enumerate(spec.nodes)}


def compute_findings(spec: ClusterSpec, per_rank: Sequence[float]) -> list[Finding]:
    if len(per_rank) != spec.world_size:
        return []  # (a rank program of another shape: nothing to compare)
    times = node_times(spec, per_rank)
    out = []
    for host, t in times.items():
        others = [v for h, v in times.items() if h != host]
        if not others:
            out.append(Finding.plain("compute", host, OK, f"probe {t:.3f} s (one node: nothing to "
                                                    "compare with)"))
            continue
        ref = median(others)
        ratio = t / ref if ref > 0 else 1.0
        if ratio > SLOW_NODE:
            out.append(SLOW.at(host, seconds=f"{t:.3f}", ratio=f"{ratio:.2f}",
                                    median=f"{ref:.3f}"))
        else:
            out.append(Finding.plain("compute", host, OK, f"probe {t:.3f} s, {ratio:.2f}x the "
                                     f"other nodes' median ({ref:.3f} s)"))
    return out
