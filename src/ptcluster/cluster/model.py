"""The validated, frozen description of a cluster.

Everything here is computed from the cluster file once; derived values (world size, node ranks,
rank ranges) are properties, never stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from ptcluster.node.venv_store import env_python

BACKENDS = ("auto", "nccl", "gloo")
DEFAULT_MASTER_PORT = 29500
AUTO_PYTHON = "auto"
"""``python:`` when a cluster file sets none: on each node the venv ``ptcluster setup`` made
(``SETUP_PYTHON``) where it exists, else the head's own interpreter path."""
SETUP_VENV = "~/.ptcluster/venv"
"""Where ``ptcluster setup`` makes each node's Python environment."""
SETUP_PYTHON = SETUP_VENV + "/bin/python"


WARM_IDLE = 600.0
"""Seconds a warm pool lives without a rank or a request (``warm: true``, ``run --warm``)."""

@dataclass(frozen=True)
class ProjectEnv:
    """A node's project environment: its key and the user's ptcluster directory that holds it
    (``node.venv_store``'s layout; ``~`` expanded on the node)."""

    digest: str
    root: str = "~/.ptcluster"
    torch: str = ""
    """The torch the head checked the environment's lock against (what it remembers of the
    node, ``venvs.known``): the guard refuses to start ranks beside another one (a launch
    without asking the node first); "" when the head just shipped it (checked then)."""


class Reach(str, Enum):
    """How the head reaches the nodes of a cluster (``remote.connect`` turns it into transports)."""

    LOCAL = "local"
    """The local cluster: this machine, no ssh."""
    SSH = "ssh"
    """OpenSSH, with the cluster file's ``ssh:`` options."""
    SRUN = "srun"
    """An ``srun`` step per node of the Slurm allocation we run in."""


@dataclass(frozen=True, kw_only=True)
class SshSpec:
    """How the head reaches a node with the OpenSSH client (``~/.ssh/config`` still applies)."""

    user: str | None = None
    """Login user; default: whatever ssh would use (``~/.ssh/config``, then the local user)."""
    port: int | None = None
    """sshd port on the node; default: ssh's own default (22 or ``~/.ssh/config``)."""
    identity_file: str | None = None
    """Private key passed with ``-i``."""
    config_file: str | None = None
    """An ssh config file passed with ``-F``."""
    options: tuple[tuple[str, str], ...] = ()
    """Extra ``-o KEY=VALUE`` options, in file order."""
    reuse: int | None = None
    """Seconds an idle connection to the node is kept for the next command (OpenSSH's
    ControlMaster/ControlPersist, sockets in a private directory); None or 0: a new one each."""

    def merged(self, override: SshSpec | None) -> SshSpec:
        """This spec with every field that ``override`` sets replaced (options merged by key)."""
        if override is None:
            return self
        options = dict(self.options)
        options.update(dict(override.options))
        return SshSpec(
            user=override.user if override.user is not None else self.user,
            port=override.port if override.port is not None else self.port,
            identity_file=override.identity_file or self.identity_file,
            config_file=override.config_file or self.config_file,
            options=tuple(options.items()),
            reuse=override.reuse if override.reuse is not None else self.reuse,
        )


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """One machine of the cluster, with every per-node override already resolved."""

    host: str
    """Hostname or IP address the head uses to reach the node (and the default master address)."""
    slots: int = 1
    """Processes started on this node (normally its GPU count)."""
    interface: str | None = None
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME on this node; None: detected on the node."""
    python: str
    """Interpreter on the node (``auto``: see ``AUTO_PYTHON``)."""
    workdir: str
    """Working directory of the job on the node."""
    ssh: SshSpec = field(default_factory=SshSpec)
    gpus: tuple[int, ...] | str | None = None
    """The GPUs this node's ranks use: None (auto where the node has GPUs), ``"auto"`` (the
    first ``slots`` free ones, leased even on a node without GPUs), or indices (leased)."""
    """Resolved ssh settings for this node (cluster-wide ``ssh`` merged with the node's own)."""
    slurm_node: str | None = None
    """Slurm's NodeName when the node is part of a Slurm allocation (started with ``srun``,
    not ssh); ``host`` is then its NodeAddr."""
    environment: ProjectEnv | None = None
    """The project's environment this node's ranks run in (``requirements:``; set by
    ``venvs.runenv``, never by the file): ``python`` is then its base, the guard's
    interpreter, and :attr:`rank_python` the environment's."""

    @property
    def rank_python(self) -> str:
        """The ranks' (and torchrun's) interpreter: the project environment's, else
        ``python``."""
        if self.environment is None:
            return self.python
        return env_python(self.environment.root, self.environment.digest)


@dataclass(frozen=True, kw_only=True)
class MasterSpec:
    """Where the rendezvous runs."""

    addr: str
    """Address every node connects to for the rendezvous."""
    port: int | None = DEFAULT_MASTER_PORT
    """Rendezvous TCP port; None (``auto``): a free port is chosen at launch, by the master
    node's guard (by the head on the local cluster), so that jobs on the same nodes never
    collide."""


@dataclass(frozen=True, kw_only=True)
class SlurmSetupSpec:
    """``slurm:`` of a cluster file (or ``setup --slurm``): what ``ptcluster setup`` makes a
    Slurm cluster of these nodes with."""

    controller: str
    """The host of the node that runs slurmctld (default: the first node)."""
    partitions: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(name, hosts) in file order; none: one partition ``main`` of every node, the default."""


@dataclass(frozen=True)
class DataSpec:
    """A ``data:`` entry (or ``run --data``): a folder of the head's pushed to every node."""

    name: str
    """Upper-cased: the ranks' ``PTCLUSTER_DATA_<NAME>``."""
    src: str
    """Absolute, on the head."""
    dest: str
    """Absolute, on every node."""


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A whole cluster: nodes in rank order plus job-wide settings."""

    nodes: tuple[NodeSpec, ...]
    master: MasterSpec
    backend: str = "auto"
    """auto (NCCL when every rank has a GPU, else gloo) | nccl | gloo."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables every rank gets, in file order. Nothing else of the head's env is shipped."""
    source: str = "<local>"
    """Where the spec came from (a file path, ``--hosts`` or ``<local>``), for messages."""
    local: bool = False
    """True for the local cluster: this machine alone, reached without ssh."""
    slurm_job: str | None = None
    """The Slurm job whose allocation these nodes are (see ``cluster/slurm.py``); None otherwise."""
    slurm: SlurmSetupSpec | None = None
    """``slurm:``: ``ptcluster setup`` installs Slurm on these nodes (None: it does not)."""
    requirements: str | None = None
    """``requirements:``: the project's declared environment (a uv.lock, pylock.toml,
    requirements*.txt or pyproject.toml), the path made absolute from the cluster file's folder;
    None: the ranks run in setup's interpreter, as without it (``ptcluster.venvs``)."""
    find_links: tuple[str, ...] = ()
    """``find_links:``: folders of wheels the head resolves from instead of an index (absolute
    paths, from the cluster file's folder)."""
    data: tuple[DataSpec, ...] = ()
    """``data:``: folders ``run`` pushes to every node before launch (``ptcluster.push``)."""
    warm: float | None = None
    """``warm:``: the idle timeout (seconds) of the warm pools ``run`` takes its ranks from;
    None: ranks start cold unless ``run --warm``."""
    warm_imports: tuple[str, ...] = ()
    """``warm_imports:``: what a warm pool imports besides torch."""
    spares: tuple[NodeSpec, ...] = ()
    """``spares:``: machines that run no rank; a restart puts one in the place of a node that
    was lost or refused (``launch.supervise.restart``). Never one of ``nodes``."""

    def __post_init__(self) -> None:
        assert self.nodes, "a cluster has at least one node"
        assert self.backend in BACKENDS, self.backend
        assert not (self.local and self.slurm_job), "the local cluster is not an allocation"
        assert not {n.host for n in self.nodes} & {s.host for s in self.spares}, \
            "a machine is a node or a spare, not both"

    @property
    def machines(self) -> tuple[NodeSpec, ...]:
        """The nodes, then the spares: every machine the head may reach for this cluster."""
        return self.nodes + self.spares

    def spares_as_nodes(self) -> ClusterSpec:
        """This cluster with its spares as its last nodes (``doctor`` checks a spare as a node,
        its all-reduce included)."""
        return replace(self, nodes=self.machines, spares=())

    @property
    def reach(self) -> Reach:
        """Derived from ``slurm_job`` and ``local`` (the facts), never stored beside them."""
        return Reach.SRUN if self.slurm_job is not None else \
            Reach.LOCAL if self.local else Reach.SSH

    @property
    def world_size(self) -> int:
        return sum(n.slots for n in self.nodes)

    def rank_base(self, node_rank: int) -> int:
        """Global rank of local rank 0 on node ``node_rank`` (ranks follow file order)."""
        return sum(n.slots for n in self.nodes[:node_rank])

    def ranks_of(self, node_rank: int) -> range:
        base = self.rank_base(node_rank)
        return range(base, base + self.nodes[node_rank].slots)
