"""What only Slurm breaks: the CPUs a node's ranks may use and the GPUs they can see.

Pure functions of the probe's ``slurm`` facts, which it collects inside the same kind of
``srun`` step the ranks run in (``remote/slurm.py``). A binding plugin (``task/affinity``,
``task/cgroup``) can leave a step one CPU or one GPU where the job has many; a job that asked
``--gpus-per-task`` gives each task only its own GPU, so NCCL cannot see the peers.
"""

from __future__ import annotations

from ptcluster.cluster.model import ClusterSpec, NodeSpec
from ptcluster.doctor import findings as F
from ptcluster.doctor.checks import OK, Finding, per_node
from ptcluster.doctor.node_report import NodeReport
from ptcluster.node.doctor_facts import DoctorFacts
from ptcluster.node.guard.gpus import spans


def check_slurm_cpus(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """sched_getaffinity of the step against the CPUs the job has on the node and the slots."""
    def one(node: NodeSpec, facts: DoctorFacts) -> Finding | None:
        slurm = facts.get("slurm")
        affinity = slurm.get("affinity") if slurm else None
        if not slurm or affinity is None:
            return None
        usable = len(affinity)
        cpus = slurm.get("cpus_on_node")
        asked = int(cpus) if cpus is not None and cpus.isdigit() else None
        where = f"CPUs {spans(affinity)}"
        if usable < node.slots:
            return F.SLURM_TOO_FEW_CPUS.at(node.host, slots=node.slots, usable=usable,
                                           where=where)
        if asked is not None and usable < asked:
            return F.SLURM_CPUS_NARROWED.at(node.host, usable=usable, asked=asked, where=where)
        return Finding.plain("slurm cpus", node.host, OK,
                       f"{usable} CPU(s) for {node.slots} rank(s) ({where}"
                       + (f"; the job has {asked} here)" if asked is not None else ")"))
    return per_node(spec, probes, "slurm cpus", one)


def check_slurm_gpus(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """GPUs the ranks can see (CUDA_VISIBLE_DEVICES of the step) against the slots."""
    def one(node: NodeSpec, facts: DoctorFacts) -> Finding | None:
        slurm = facts.get("slurm")
        if not slurm:
            return None
        gpus = facts.get("gpus")
        present = gpus["count"] if gpus else 0
        cvd = slurm.get("cuda_visible_devices")
        visible = present if cvd is None else len([d for d in cvd.split(",") if d.strip()])
        if present == 0 and not cvd:
            return Finding.plain("slurm gpus", node.host, OK, "no GPU on this node: CPU ranks")
        shown = f"CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else "no CUDA_VISIBLE_DEVICES"
        if visible < node.slots and spec.backend != "gloo":
            return F.SLURM_GPUS_HIDDEN.at(node.host, slots=node.slots, visible=visible,
                                          shown=shown, present=present)
        return Finding.plain("slurm gpus", node.host, OK,
                       f"{visible} GPU(s) visible to {node.slots} rank(s) ({shown})")
    return per_node(spec, probes, "slurm gpus", one)


def slurm_checks(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    return check_slurm_cpus(spec, probes) + check_slurm_gpus(spec, probes)
