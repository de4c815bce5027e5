"""Spec -> :class:`LaunchPlan`: per node, its node rank, process count, argv and env.

Pure functions: no network, no processes. ``ptcluster env`` prints exactly what this computes,
and the runner executes exactly this.
"""

from __future__ import annotations

import secrets
import shlex
import socket
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from ptcluster.cluster.model import ClusterSpec, NodeSpec, ProjectEnv
from ptcluster.node import wire
from ptcluster.node.facts.health_facts import HealthContext
from ptcluster.node.rank_wire import (
    ATTEMPT_VAR,
    BACKEND_VAR,
    FR_DEFAULT,
    FR_VAR,
    IFNAME_VARS,
    JOB_VAR,
    MAX_RESTARTS_VAR,
    SHIM_BOOT,
    THREADS_DEFAULT,
    THREADS_VAR,
)

if TYPE_CHECKING:
    from ptcluster.launch.options import RunOptions


LOCAL_RANK_ARGS = {"dash": "--local-rank", "underscore": "--local_rank"}
"""``run --local-rank-arg``: the argument ``python -m torch.distributed.launch`` gives every
process, ``--local-rank=N`` since torch 2.0 (``dash``), ``--local_rank=N`` before."""
LOCAL_RANK_MACRO = "${local_rank}"
"""torchrun replaces this in every argument of a worker by its local rank
(``torch.distributed.elastic.utils.api.macros``): how torch.distributed.launch passes it."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """What every rank runs: a module (``-m``), a script, or source code (``-c``, shipped in
    the guard's JSON config, so it needs no file on the nodes), with its arguments."""

    module: str | None = None
    script: str | None = None
    code: str | None = None
    args: tuple[str, ...] = ()
    local_rank_arg: str | None = None
    """``dash`` or ``underscore``: the target gets ``--local-rank=N`` (``--local_rank=N``)
    before its own arguments, as torch.distributed.launch gave it (a script written for that
    launcher runs unchanged); None: only ``LOCAL_RANK`` in the environment, as torchrun."""

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.module, self.script, self.code)) != 1:
            raise ValueError("give exactly one of module, script or code")
        if self.local_rank_arg is not None and self.local_rank_arg not in LOCAL_RANK_ARGS:
            raise ValueError(f"local_rank_arg is one of {', '.join(LOCAL_RANK_ARGS)}, got "
                             f"{self.local_rank_arg!r}")

    def program(self) -> list[str]:
        """What runs, without its arguments: ``-m MODULE``, ``SCRIPT`` or ``-c CODE``."""
        if self.module is not None:
            return ["-m", self.module]
        if self.code is not None:
            return ["-c", self.code]
        return [self.script or ""]

    def argv(self) -> list[str]:
        """The program, then ``--local-rank=N`` where asked (where that launcher put it),
        then its arguments."""
        local_rank = [] if self.local_rank_arg is None else \
            [f"{LOCAL_RANK_ARGS[self.local_rank_arg]}={LOCAL_RANK_MACRO}"]
        return self.program() + local_rank + list(self.args)

    def describe(self, width: int = 120) -> str:
        """The program as a person would name it, for others to see (a lease record, ``ps``:
        world-readable on every node): ``python train.py``, ``python -m pkg.mod``, ``python -c
        …``. Never its arguments (a ``--token X`` would be every user's to read); cut at
        ``width``."""
        text = "python -c …" if self.code is not None else shlex.join(["python",
                                                                        *self.program()])
        return text if len(text) <= width else text[:width - 1] + "…"


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    host: str
    node_rank: int
    nproc: int
    rank_base: int
    python: str
    workdir: str
    interface: str | None
    """Socket interface for NCCL/Gloo; None: the guard detects the route to the master."""
    argv: tuple[str, ...]
    """torchrun command line, run by the guard on the node."""
    env: tuple[tuple[str, str], ...]
    """What we add to the node's environment for torchrun and its ranks: configuration only
    (the guard adds its socket and the path of the shim it writes)."""
    is_master: bool
    target: Target
    gpus: tuple[int, ...] | str | None = None
    """``gpus:`` of the cluster file: None (auto where the node has GPUs), "auto", or indices."""
    environment: ProjectEnv | None = None
    """The project's environment ``argv`` runs in (``python`` is its base: the guard's), which
    the guard checks before anything starts."""

    @property
    def ranks(self) -> range:
        return range(self.rank_base, self.rank_base + self.nproc)

    def guard_config(self, plan: LaunchPlan, opts: RunOptions) -> wire.GuardConfig:
        """Everything the node's guard is told (plus the runner's timing knobs): its config
        line, typed where both ends read it (``node.wire.GuardConfig``)."""
        target: wire.Target = {"script": self.target.script} if self.target.script else \
            {"module": self.target.module} if self.target.module else \
            {"cwd": wire.PRIVATE_CWD}
        config: wire.GuardConfig = {
            "job_id": plan.job_id, "argv": list(self.argv), "env": dict(self.env),
            "workdir": self.workdir, "target": target,
            "check_port": (plan.master_port or "auto") if self.is_master else None,
            "head": socket.gethostname(), "command": self.target.describe(),
            "ranks": [self.ranks.start, self.ranks.stop - 1], "slots": self.nproc,
            "gpus": list(self.gpus) if isinstance(self.gpus, tuple) else self.gpus,
            "interface": self.interface,
            "detect_interface_for": None if self.interface else plan.master_addr,
            "heartbeat_timeout": opts.guard_heartbeat_timeout, "grace": opts.stop_grace,
            "heartbeat_every": opts.heartbeat_for(len(plan.nodes)),
            "output_hold": opts.output_hold_for(len(plan.nodes)),
            "env_defaults": threads_default(plan), "leases": opts.leases,
            **({"environment": {"digest": self.environment.digest,
                                "root": self.environment.root,
                                "torch": self.environment.torch}} if self.environment else {}),
        }
        warm = self.warm_config(plan, opts)
        if warm is not None:
            config["warm"] = warm
        return config

    def warm_config(self, plan: LaunchPlan, opts: RunOptions) -> wire.WarmConfig | None:
        """``GuardConfig.warm``: this user's pool (``run --warm``), or the job's own pool on
        the node when restarts may follow (``--max-restarts``; not ``--cold``), or None."""
        if opts.warm:
            return {"idle": opts.warm, "imports": list(opts.warm_imports),
                    "world": plan.world_size}
        if not opts.restart_pool or int(dict(self.env).get(MAX_RESTARTS_VAR, "0")) <= 0:
            return None
        return {"idle": wire.JOB_POOL_WITHIN, "imports": list(opts.warm_imports),
                "world": plan.world_size, "job": self.host}


def health_context(node: NodePlan, checkpoint: str | None = None) -> HealthContext:
    """The context of ``node.facts.health.health`` for ``node`` as its guard would give it (the
    workdir, slots, backend, GPUs chosen; ``checkpoint``: where it saved last): what a probe
    of a lost node asks its health gate with (``run --readmit``)."""
    env = dict(node.env)
    return {"workdir": node.workdir, "slots": node.nproc,
            "checkpoints": [checkpoint] if checkpoint else [],
            "backend": env.get(BACKEND_VAR),
            "chosen": isinstance(node.gpus, tuple) or "CUDA_VISIBLE_DEVICES" in env}


AUTO_PORT = 0
"""``master_port`` of a plan whose master node's guard takes a free port at launch (``master.port:
auto``); the head tells every node the port with ``go``."""


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    job_id: str
    master_addr: str
    master_port: int
    """The rendezvous port, or :data:`AUTO_PORT`."""
    world_size: int
    backend: str
    nodes: tuple[NodePlan, ...]
    attempt: int = 0
    """0 for the first attempt; a restart's plan counts up (``PTCLUSTER_ATTEMPT``)."""


def plan_json(plan: LaunchPlan, opts: RunOptions) -> dict[str, Any]:
    """The plan as shipped, what the run directory's ``plan.json`` holds: per node, the guard's
    whole config (configuration only: the code travels in the guard's program)."""
    data: dict[str, Any] = {k: v for k, v in asdict(plan).items() if k != "nodes"}
    data["options"] = asdict(opts)
    data["nodes"] = []
    for node in plan.nodes:
        cfg = node.guard_config(plan, opts)
        data["nodes"].append({"host": node.host, "node_rank": node.node_rank,
                              "ranks": [node.ranks.start, node.ranks.stop - 1],
                              "python": node.python, "guard": cfg})
    return data


def threads_default(plan: LaunchPlan) -> dict[str, str]:
    """``OMP_NUM_THREADS`` where a node has no value of its own: 1 on every rank of a job of
    several ranks, whatever the number of ranks on its node.

    torchrun sets 1 only on nodes of several ranks (ptcluster sets it there itself, so that
    torchrun does not print its four-line banner on every run). A node with one rank then ran
    its kernels on every core while the others ran on one, and DDP's replicas did not stay
    bit-identical: the reference trainer's in-step check found one rank's state different in
    about half the runs of a 2+1+1 CPU job on the testbed (at 18d4054 too; none in 5 runs with
    the same threads on every rank). DDP keeps replicas in step only if every rank computes the
    same update from the same averaged gradients, so every rank gets the same threads."""
    return {THREADS_VAR: THREADS_DEFAULT} if plan.world_size > 1 else {}


def new_job_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def torchrun_argv(spec: ClusterSpec, node: NodeSpec, node_rank: int, port: int,
                  target: Target) -> list[str]:
    return [
        node.rank_python, "-m", "torch.distributed.run",
        "--nnodes", str(len(spec.nodes)),
        "--node-rank", str(node_rank),
        "--nproc-per-node", str(node.slots),
        "--master-addr", spec.master.addr,
        "--master-port", str(port),
        "--max-restarts", "0",
        # No --tee/--redirects: every rank's output reaches the guard through the shim.
        "--no-python", node.rank_python, "-u", "-c", SHIM_BOOT,
        *target.argv(),
    ]


def node_env(spec: ClusterSpec, node: NodeSpec, job_id: str, attempt: int = 0,
             max_restarts: int = 0) -> list[tuple[str, str]]:
    env = list(spec.env)
    env.append(("PYTHONUNBUFFERED", "1"))
    env.append((BACKEND_VAR, spec.backend))
    env.append((JOB_VAR, job_id))
    env.append((ATTEMPT_VAR, str(attempt)))
    env.append((MAX_RESTARTS_VAR, str(max_restarts)))
    if not any(k == FR_VAR for k, _ in spec.env):  # the user's own setting wins
        env.append((FR_VAR, FR_DEFAULT))
    if node.interface:
        env += [(var, node.interface) for var in IFNAME_VARS]
    return env


def plan_launch(spec: ClusterSpec, target: Target, *, port: int, job_id: str, attempt: int = 0,
                max_restarts: int = 0) -> LaunchPlan:
    """The whole job: node ``i`` of the file gets node rank ``i`` and the next ``slots`` ranks.
    A restart (``attempt`` > 0) is planned the same way over the nodes that remain."""
    nodes = []
    for i, node in enumerate(spec.nodes):
        nodes.append(NodePlan(
            host=node.host, node_rank=i, nproc=node.slots, rank_base=spec.rank_base(i),
            python=node.python, workdir=node.workdir, interface=node.interface,
            argv=tuple(torchrun_argv(spec, node, i, port, target)),
            env=tuple(node_env(spec, node, job_id, attempt, max_restarts)),
            is_master=i == 0,  # static rendezvous: node rank 0 hosts the store
            target=target, gpus=node.gpus, environment=node.environment,
        ))
    return LaunchPlan(job_id=job_id, master_addr=spec.master.addr, master_port=port,
                      world_size=spec.world_size, backend=spec.backend, nodes=tuple(nodes),
                      attempt=attempt)


def restart_port(first: int, attempt: int) -> int:
    """The rendezvous port of restart ``attempt`` of a job that began on port ``first``: a
    fresh one, so a fresh store (no key of the failed attempt is seen again: pytorch#135712),
    counting down past 65535; :data:`AUTO_PORT` stays (the new master's guard takes one)."""
    if first == AUTO_PORT:
        return AUTO_PORT
    port = first + attempt
    return port if port <= 65535 else first - attempt


def replan(spec: ClusterSpec, target: Target, *, job_id: str, attempt: int,
           hosts: tuple[str, ...], addresses: dict[str, str], port: int,
           max_restarts: int) -> LaunchPlan:
    """The plan of restart ``attempt``: the same job over the nodes that remain (``hosts``, in
    their order: the remaining nodes in file order, then the spares that take lost nodes'
    places; ranks renumbered) on ``port``, node rank 0 hosting the rendezvous. When the
    master's node was dropped, the next node in the file takes over, at its ``host``; or, when
    the cluster file gave the master an address of its own (a fabric address, while ``host`` is
    how the head reaches it), at the address that node's guard reported on its interface
    (``addresses``: the one it chose to reach the old master, the same network), or at its
    host when it reported none (an interface list or prefix in the cluster file names no one
    address)."""
    machine = {n.host: n for n in spec.machines}
    nodes = tuple(machine[h] for h in hosts)
    master = spec.master
    if nodes[0].host != spec.nodes[0].host:
        own = spec.master.addr != spec.nodes[0].host and addresses.get(nodes[0].host)
        master = replace(master, addr=own or nodes[0].host)
    spares = tuple(s for s in spec.spares if s.host not in hosts)
    return plan_launch(replace(spec, nodes=nodes, master=master, spares=spares), target,
                       port=port,
                       job_id=job_id, attempt=attempt, max_restarts=max_restarts)


def rank_env(plan: LaunchPlan, node: NodePlan) -> list[tuple[str, str]]:
    """What every rank on ``node`` sees (ours plus torchrun's), for ``ptcluster env``: the
    values known now. Those chosen only at launch are in :func:`rank_env_at_launch`.

    RANK and LOCAL_RANK differ per process; they are given as ranges in the caller's output.
    An interface detected on the node at launch is in ``summary.json``, not here.
    """
    env = list(node.env)
    if THREADS_VAR not in dict(node.env):  # (unless the node has its own)
        env += threads_default(plan).items()
    env.append(("MASTER_ADDR", plan.master_addr))
    if plan.master_port:
        env.append(("MASTER_PORT", str(plan.master_port)))
    env += [
        ("WORLD_SIZE", str(plan.world_size)),
        ("NODE_RANK", str(node.node_rank)),
        ("GROUP_RANK", str(node.node_rank)),
        ("LOCAL_WORLD_SIZE", str(node.nproc)),
    ]
    if isinstance(node.gpus, tuple):
        env.append(("CUDA_VISIBLE_DEVICES", ",".join(map(str, node.gpus))))
    return env


def rank_env_at_launch(plan: LaunchPlan, node: NodePlan) -> list[tuple[str, str]]:
    """The variables of :func:`rank_env` whose value is chosen only when the job starts, each
    with how it is chosen: text for a reader, never a value to export."""
    later = []
    if not plan.master_port:
        later.append(("MASTER_PORT", "chosen at launch (the master's guard takes a free one)"))
    if not isinstance(node.gpus, tuple):
        later.append(("CUDA_VISIBLE_DEVICES", f"the first {node.nproc} free GPUs, leased at launch"
                      + ("" if node.gpus == "auto" else " (on a node that has GPUs)")))
    mine = {k if not k.startswith("NCCL_DEBUG") else "NCCL_DEBUG" for k, _ in node.env}
    return later + [(k, how) for k, how in NCCL_AT_LAUNCH if k not in mine]


NCCL_AT_LAUNCH = (
    ("NCCL_IB_HCA", "the node's ACTIVE RDMA ports, where it has HCAs (node.facts.rdma)"),
    ("NCCL_IB_GID_INDEX", "the node's routable RoCE v2 GID, where it has RoCE HCAs"),
    ("NCCL_DEBUG", "INFO on a GPU node (and NCCL_DEBUG_SUBSYS, NCCL_DEBUG_FILE: a file per rank "
     "in the job's directory, read for what NCCL chose), unless env: sets them"))
"""What the guard adds for NCCL on the node (``node.guard.spawn.rank_env``), unless set."""
