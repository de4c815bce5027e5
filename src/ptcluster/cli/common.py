"""Options and helpers shared by the subcommands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ptcluster.errors import UsageError
from ptcluster.launch.job import local_gpu_count
from ptcluster.spec import ClusterSpec, find_cluster_file, load_cluster_file, local_cluster

F = TypeVar("F", bound=Callable[..., Any])


def cluster_option(func: F) -> F:
    return click.option(
        "--cluster", "cluster", metavar="FILE", default=None,
        help="Cluster file (default: ./cluster.yaml, else $PTCLUSTER_CLUSTER, else this machine).",
    )(func)


def default_nproc() -> int:
    """GPUs on this machine, or 2 on a CPU-only one."""
    return local_gpu_count() or 2


def load_spec(cluster: str | None, nproc: int | None = None) -> ClusterSpec:
    path = find_cluster_file(cluster)
    if path is None:
        if nproc is not None and nproc < 1:
            raise UsageError("--nproc must be >= 1", "pass --nproc 1 or more")
        return local_cluster(nproc or default_nproc())
    if nproc is not None:
        raise UsageError(f"--nproc applies to the local cluster only, but {path} is in use",
                         f"set slots: per node in {path}")
    return load_cluster_file(path)
