"""``run``'s data: the cluster file's ``data:`` entries and ``--data SRC[=DEST]``, and the
variables the ranks get for them (``node.rank_wire``'s names)."""

from __future__ import annotations

import dataclasses
import os
import re

from ptcluster.cluster.model import ClusterSpec, DataSpec
from ptcluster.errors import UsageError
from ptcluster.node.rank_wire import DATA_VAR, DATA_VAR_PREFIX


def from_flag(value: str) -> DataSpec:
    """``SRC`` or ``SRC=DEST`` (DEST absolute; default SRC's absolute path); its name is SRC's
    folder name, upper-cased, other characters than letters and digits as ``_``."""
    src, eq, dest = value.partition("=")
    if not src or (eq and not dest):
        raise UsageError(f"--data {value!r} is not SRC or SRC=DEST", "e.g. --data data/train="
                         "/data/train")
    src = os.path.abspath(os.path.expanduser(src))
    dest = dest or src
    if not dest.startswith("/"):
        raise UsageError(f"--data {value!r}: {dest!r} is not an absolute path",
                         "give DEST as an absolute folder on the nodes")
    name = re.sub(r"[^A-Za-z0-9]", "_", os.path.basename(src.rstrip("/")) or "data").upper()
    return DataSpec(name, src, dest)


def entries(spec: ClusterSpec, flags: tuple[str, ...]) -> tuple[DataSpec, ...]:
    """The file's entries, then the flags' (a flag's name taken already: ``NAME_2``...)."""
    out = list(spec.data)
    for value in flags:
        entry = from_flag(value)
        names, n, name = {d.name for d in out}, 1, entry.name
        while name in names:
            n += 1
            name = f"{entry.name}_{n}"
        out.append(dataclasses.replace(entry, name=name))
    return tuple(out)


def with_data(spec: ClusterSpec, data: tuple[DataSpec, ...]) -> ClusterSpec:
    """``spec`` whose ranks get ``PTCLUSTER_DATA_<NAME>`` for each entry and
    ``PTCLUSTER_DATA`` for the first (after the file's ``env:``, which cannot override them)."""
    if not data:
        return spec
    ours = {DATA_VAR_PREFIX + d.name: d.dest for d in data}
    ours[DATA_VAR] = data[0].dest
    kept = tuple((k, v) for k, v in spec.env if k not in ours)
    return dataclasses.replace(spec, env=(*kept, *ours.items()), data=data)
