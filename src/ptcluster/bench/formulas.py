"""Sizes and bandwidths exactly as NVIDIA nccl-tests defines them (doc/PERFORMANCE.md there).

algbw = S / t, with S the op's "size" column: the per-rank buffer for all_reduce, broadcast
and sendrecv, and the total over ranks (count x n) for all_gather and reduce_scatter.
busbw  = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather, reduce_scatter),
         x 1 (broadcast, sendrecv). GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import re

from ptcluster.errors import UsageError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv")
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8', '64K', '64M', '1G' (1024-based) -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise UsageError(f"bad size {text!r}", "write bytes with an optional K, M or G suffix, "
                         "e.g. 8, 64K, 64M")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[
        m.group(2).upper()]


def sizes(minbytes: int, maxbytes: int, factor: int | None = 2,
          step: int | None = None) -> list[int]:
    """nccl-tests' -b/-e with -f (multiply) or -i (add)."""
    if minbytes < 1 or maxbytes < minbytes:
        raise UsageError(f"bad size range {minbytes}..{maxbytes}", "use -b <= -e, both >= 1")
    out, size = [], minbytes
    if step:
        while size <= maxbytes:
            out.append(size)
            size += step
        return out
    if factor is None or factor < 2:
        raise UsageError("-f must be >= 2", "e.g. -f 2")
    while size <= maxbytes:
        out.append(size)
        size *= factor
    return out


def count_for(op: str, size: int, nranks: int, elem: int) -> int:
    """Elements per rank buffer for a requested size (the input for all_gather, the output for
    reduce_scatter), rounded down as nccl-tests does; 0 means the size is too small."""
    if op in ("all_gather", "reduce_scatter"):
        return size // (elem * nranks)
    return size // elem


def size_for(op: str, count: int, nranks: int, elem: int) -> int:
    """The "size" column (bytes) for a per-rank count."""
    if op in ("all_gather", "reduce_scatter"):
        return count * elem * nranks
    return count * elem


def redop_for(op: str) -> str:
    """nccl-tests' "redop" column: the reduction the op applies."""
    return "sum" if op in ("all_reduce", "reduce_scatter") else "none"


def root_for(op: str) -> int:
    """nccl-tests' "root" column: the source rank of a rooted op, -1 for the others."""
    return 0 if op == "broadcast" else -1


def bus_factor(op: str, nranks: int) -> float:
    if op == "all_reduce":
        return 2 * (nranks - 1) / nranks
    if op in ("all_gather", "reduce_scatter"):
        return (nranks - 1) / nranks
    if op in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(op)


def bandwidths(op: str, size: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s."""
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * bus_factor(op, nranks)
