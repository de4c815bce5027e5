"""A recorded-shape bench sweep for the tests that render or judge one without running it."""

from __future__ import annotations

from ptcluster.bench.formulas import OPS, bandwidths
from ptcluster.bench.sweep import BenchResult, Row


def sweep_result(pairs: bool) -> BenchResult:
    rows = []
    for op in OPS:
        for e in range(3, 21):
            size, seconds = 1 << e, 20e-6 + (1 << e) / 50e9
            algbw, busbw = bandwidths(op, size, seconds, 8)
            rows.append(Row(op=op, size=size, count=size // 4, type="float32", redop="sum",
                            root=-1, time_us=seconds * 1e6, algbw=algbw, busbw=busbw, wrong=0))
    hosts = ["node0", "node1", "node2"]
    return BenchResult(world_size=8, backend="nccl", rows=rows, pairs=[
        {"a": hosts[i], "b": hosts[j], "bytes": 16 << 20, "gbps": 10.0 * (i + j + 1)}
        for i in range(3) for j in range(i + 1, 3)] if pairs else [])


def footer(text: str) -> dict[str, str]:
    """The ``# name : value`` lines that end a bench table (nccl-tests' footer: ``Out of bounds
    values``, ``Avg bus bandwidth``), by name."""
    return {name.strip(): value.strip() for name, _, value in
            (line[2:].partition(" : ") for line in text.splitlines()
             if line.startswith("# ") and " : " in line)}
