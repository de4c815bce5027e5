"""Inside a Slurm allocation: the cluster is the allocation's nodes.

``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST`` (set by ``salloc``, ``sbatch`` and ``srun``) say we
are in one. The nodes come from ``scontrol show hostnames`` (Slurm's own expansion of
``sl[0-2,5]``), their addresses from each node's ``NodeAddr`` — the address slurmd was
configured with, never the output of ``hostname`` or the node name, which on many clusters
resolve to a management network or to nothing. The first node hosts the rendezvous.

Slots per node: ``--nproc`` when given; else the allocation's GPUs per node; else the tasks per
node the job asked for (``-n`` / ``--ntasks-per-node``); else 1.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ptcluster.cluster.model import DEFAULT_MASTER_PORT, ClusterSpec, MasterSpec, NodeSpec
from ptcluster.errors import UsageError

Runner = Callable[[list[str]], str]
"""Runs a Slurm client command and returns its stdout (raises :class:`SlurmError`)."""


class SlurmError(UsageError):
    """Slurm's clients failed or said something we cannot use."""


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """What the environment of a Slurm job says about it."""

    job_id: str
    """``SLURM_JOB_ID``."""
    nodelist: str
    """``SLURM_JOB_NODELIST`` in Slurm's compressed form (``sl[0-2]``)."""
    gpus_per_node: int | None = None
    """GPUs the job has on each node (``SLURM_GPUS_PER_NODE``, else ``SLURM_GPUS_ON_NODE``)."""
    tasks_per_node: tuple[int, ...] | None = None
    """Tasks per node in node order, only when the job asked for tasks (``-n``,
    ``--ntasks-per-node``): ``SLURM_TASKS_PER_NODE`` expanded (``2,1(x2)`` -> 2, 1, 1)."""

    def __post_init__(self) -> None:
        if not self.job_id or not self.nodelist:
            raise ValueError("an allocation has a job id and a node list")


def allocation_from_env(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this process runs in, or None outside one."""
    env = os.environ if env is None else env
    job, nodelist = env.get("SLURM_JOB_ID", ""), env.get("SLURM_JOB_NODELIST", "")
    if not job or not nodelist:
        return None
    gpus = _count(env.get("SLURM_GPUS_PER_NODE")) or _count(env.get("SLURM_GPUS_ON_NODE"))
    asked = env.get("SLURM_NTASKS") or env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_NPROCS")
    tasks = parse_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", "")) if asked else None
    return Allocation(job_id=job, nodelist=nodelist, gpus_per_node=gpus or None,
                      tasks_per_node=tasks or None)


def _count(value: str | None) -> int:
    """``2`` or ``a100:2`` -> 2; anything else 0."""
    if not value:
        return 0
    m = re.fullmatch(r"(?:[\w.-]+:)?(\d+)", value.strip())
    return int(m.group(1)) if m else 0


def parse_tasks_per_node(value: str) -> tuple[int, ...]:
    """Slurm's ``SLURM_TASKS_PER_NODE`` form, ``2(x3),1``, expanded; () when malformed."""
    out: list[int] = []
    for part in filter(None, value.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return ()
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return tuple(out)


def parse_node_addrs(text: str) -> dict[str, str]:
    """NodeName -> NodeAddr from ``scontrol -o show node`` (one record per line)."""
    addrs = {}
    for line in text.splitlines():
        name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
        addr = re.search(r"(?:^|\s)NodeAddr=(\S+)", line)
        if name and addr:
            addrs[name.group(1)] = addr.group(1)
    return addrs


def slurm_cluster(alloc: Allocation, nproc: int | None = None, *,
                  scontrol: Runner, port: int | None = None) -> ClusterSpec:
    """The cluster of ``alloc``: its nodes in Slurm's order, reached with ``srun``. ``scontrol``
    asks Slurm (``remote.slurm.run_scontrol``; a spec reads, it does not run commands)."""
    names = scontrol(["show", "hostnames", alloc.nodelist]).split()
    if not names:
        raise SlurmError(f"Slurm job {alloc.job_id}: no nodes in {alloc.nodelist!r}",
                         "run inside a live allocation (salloc / sbatch)")
    addrs = parse_node_addrs(scontrol(["-o", "show", "node", alloc.nodelist]))
    missing = [n for n in names if n not in addrs]
    if missing:
        raise SlurmError(f"Slurm job {alloc.job_id}: no NodeAddr for {', '.join(missing)}",
                         "check scontrol show node; or pass --cluster")
    slots = _slots(alloc, nproc, len(names))
    nodes = tuple(NodeSpec(host=addrs[name], slots=n, python=sys.executable,
                           workdir=os.getcwd(), slurm_node=name)
                  for name, n in zip(names, slots, strict=True))
    if len(set(addrs[n] for n in names)) != len(names):
        raise SlurmError(f"Slurm job {alloc.job_id}: nodes share a NodeAddr "
                         f"({', '.join(f'{n}={addrs[n]}' for n in names)})",
                         "give every node its own NodeAddr in slurm.conf")
    return ClusterSpec(nodes=nodes,
                       master=MasterSpec(addr=nodes[0].host, port=port or job_port(alloc.job_id)),
                       source=f"Slurm job {alloc.job_id}", slurm_job=alloc.job_id)


def _slots(alloc: Allocation, nproc: int | None, n_nodes: int) -> list[int]:
    if nproc is not None:
        if nproc < 1:
            raise UsageError("--nproc must be >= 1", "pass --nproc 1 or more")
        return [nproc] * n_nodes
    if alloc.gpus_per_node:
        return [alloc.gpus_per_node] * n_nodes
    if alloc.tasks_per_node and len(alloc.tasks_per_node) == n_nodes:
        return list(alloc.tasks_per_node)
    return [1] * n_nodes


def job_port(job_id: str) -> int:
    """The rendezvous port of a job: 29500 plus the job id modulo 1000, so that two jobs
    sharing a node rarely collide on one fixed port (``--port`` overrides it)."""
    digits = re.match(r"\d+", job_id)
    return DEFAULT_MASTER_PORT + (int(digits.group(0)) % 1000 if digits else 0)


def describe(spec: ClusterSpec) -> str:
    """The one line every command prints when it takes its nodes from Slurm."""
    nodes = ", ".join(f"{n.slurm_node} ({n.host}) x{n.slots}" for n in spec.nodes)
    return (f"using Slurm job {spec.slurm_job}: {len(spec.nodes)} node(s), "
            f"{spec.world_size} rank(s): {nodes}")
