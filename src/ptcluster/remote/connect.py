"""The one place that chooses how the head reaches each node, for every command that talks to
nodes (run, doctor, monitor, bench): this machine itself (the local cluster), an ``srun`` step
(a node of the Slurm allocation we run in), else OpenSSH. ``setup`` and ``sync`` are SSH by
nature (setup installs the SSH key; sync runs rsync over it) and use the same ``ssh:`` options.
"""

from __future__ import annotations

from collections.abc import Callable

from ptcluster.cluster.model import ClusterSpec, NodeSpec, Reach
from ptcluster.remote.slurm import SrunTransport, ended_by_slurm
from ptcluster.remote.transport import LocalTransport, SshTransport, Transport


def transport(spec: ClusterSpec, node: NodeSpec) -> Transport:
    if spec.reach is Reach.SRUN:  # an allocation's node: an srun step, not ssh
        return SrunTransport(host=node.host, node=node.slurm_node or node.host,
                             job_id=str(spec.slurm_job))
    if spec.reach is Reach.LOCAL:
        return LocalTransport(host=node.host)
    return SshTransport(host=node.host, ssh=node.ssh)


def transports(spec: ClusterSpec) -> dict[str, Transport]:
    """Every machine's transport: the nodes' and the spares' (a restart may run on one)."""
    return {node.host: transport(spec, node) for node in spec.machines}


def outside_stop(spec: ClusterSpec) -> Callable[[], str | None] | None:
    """Who can end the job from outside, asked after a failed attempt (``Runner.ended_by``):
    in a Slurm allocation, Slurm (scancel, the time limit, preemption, a requeue)."""
    job = spec.slurm_job
    return None if job is None else (lambda: ended_by_slurm(job))
