"""Every key a cluster file may hold: its type, default, an example and what it does. One table.

The loader (``cluster/load.py``) takes the keys it accepts at each level from this table
(``keys_at``), so a key cannot be read without being described here; the docs' cluster-file
reference is generated from it, and a test checks that every key has its type, default,
example and text. Plain data, as ``launch.supervise.known`` is for the known failures.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptcluster.cluster.model import BACKENDS, DEFAULT_MASTER_PORT


@dataclass(frozen=True, kw_only=True)
class Key:
    """One cluster-file key."""

    path: str
    """Where it sits: ``nodes``, ``nodes[].slots``, ``ssh.user``, ``nodes[].ssh.user``…"""
    type: str
    """The YAML value it takes, in words."""
    default: str
    """What applies when it is absent."""
    example: str
    """A YAML line (or flow value) a user could write."""
    doc: str
    """What it does."""

    @property
    def level(self) -> str:
        """The mapping it belongs to: ``""`` (top), ``nodes[]``, ``master``, ``ssh``."""
        return self.path.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]


_SSH = (
    ("user", "string", "ssh's own (`~/.ssh/config`, then your login name)", "user: ubuntu",
     "Login user on the node."),
    ("port", "integer 1-65535", "ssh's own (22, or `~/.ssh/config`)", "port: 2222",
     "The node's sshd port."),
    ("identity_file", "path", "ssh's own keys", "identity_file: ~/.ssh/id_ed25519",
     "Private key passed to ssh with `-i`."),
    ("config_file", "path", "none (your `~/.ssh/config` applies as always)",
     "config_file: ~/.ssh/lab.conf",
     "An ssh config file passed with `-F`. Outside `~/.ssh` only with `--trust-cluster-file`."),
    ("options", "mapping of ssh option to value", "none",
     "options: {ServerAliveInterval: 5}",
     "Extra `-o KEY=VALUE` options, in file order. Options that run a program on this machine "
     "or change which host keys ssh trusts (`ProxyCommand`, `LocalCommand`, "
     "`StrictHostKeyChecking no`, `UserKnownHostsFile`, …) need `--trust-cluster-file`; "
     "`ProxyJump` and the options that only tune the connection do not."),
    ("reuse", "integer seconds 0-86400", "0 (a new connection per command)", "reuse: 60",
     "Keep an idle connection this long for the next command (OpenSSH's ControlMaster and "
     "ControlPersist; sockets in a directory only you can read), so `doctor` then `run` "
     "connect to each node once."),
)

_PER_NODE = (
    ("interface", "network interface name", "detected on each node (the one that routes to "
     "the master)", "interface: eth0",
     "`NCCL_SOCKET_IFNAME` and `GLOO_SOCKET_IFNAME` for the ranks: the interface the "
     "collectives use."),
    ("python", "path", "auto: the venv `ptcluster setup` made (`~/.ptcluster/venv`) where the "
     "node has one, else the head's interpreter path",
     "python: /opt/venv/bin/python",
     "The interpreter with torch on the nodes. A path starting with `~/` is the node's home. "
     "One inside the cluster file's own directory needs `--trust-cluster-file`."),
    ("workdir", "path", "the head's current directory", "workdir: /shared/project",
     "The job's working directory on the nodes (a shared filesystem, or a copy made with "
     "`ptcluster sync`). A path starting with `~/` is the node's home."),
    ("gpus", "`auto` or a list of GPU indices", "auto on a node that has GPUs", "gpus: [4, 5]",
     "The GPUs the ranks use, leased for the job: `auto` takes the first `slots` GPUs no "
     "other ptcluster job holds and no process uses; a list takes exactly those. The ranks "
     "see only them (`CUDA_VISIBLE_DEVICES`)."),
)

_NODE_ENTRY: tuple[Key, ...] = (
    Key(path="nodes[].host", type="hostname or IP address", default="required",
        example="host: 192.168.1.10",
        doc="How the head reaches the node (and the default master address). Each machine "
            "once."),
    Key(path="nodes[].slots", type="integer >= 1", default="1", example="slots: 2",
        doc="Processes (ranks) started on this node: normally its GPU count."),
    *(Key(path=f"nodes[].{name}", type=type_, default=f"the cluster-wide `{name}`",
          example=example, doc=f"This node's own `{name}`, instead of the cluster-wide one.")
      for name, type_, _default, example, _doc in _PER_NODE),
    Key(path="nodes[].ssh", type="mapping (the keys of `ssh`)", default="the cluster-wide `ssh`",
        example="ssh: {user: admin, port: 2222}",
        doc="This node's ssh settings, merged over the cluster-wide `ssh` key by key."),
)
"""The keys of one ``nodes:`` entry (a ``spares:`` entry takes the same)."""

KEYS: tuple[Key, ...] = (
    Key(path="nodes", type="list of mappings (or `host:slots` strings)", default="required",
        example="nodes: [{host: 10.0.0.1, slots: 2}, node2:1]",
        doc="The machines, in rank order: the first node hosts the rendezvous and gets the "
            "first ranks."),
    *_NODE_ENTRY,
    Key(path="spares", type="list of mappings (or `host:slots` strings), like `nodes`",
        default="none", example="spares: [{host: node5, slots: 2}]",
        doc="Hot spares: machines that run no rank while the job is whole. When `run "
            "--max-restarts` restarts the job after a node was lost or refused by its health "
            "gate, the first spare left takes that node's place with its own `slots` (its "
            "ranks after the remaining nodes'); a spare that fails to join is dropped and the "
            "next one (or `--min-nodes`) applies. `setup`, `sync`, `data:` and the project's "
            "environment reach spares as nodes, `doctor` checks them as nodes (all-reduce "
            "too), `ps` shows them; an idle spare runs nothing and holds no lease. A machine "
            "is a node or a spare, not both."),
    *(Key(path=f"spares[].{k.name}", type=k.type, default=k.default, example=k.example,
          doc=k.doc.replace("This node's", "This spare's").replace("the node", "the spare"))
      for k in _NODE_ENTRY),
    *(Key(path=f"spares[].ssh.{name}", type=type_, default=f"the cluster-wide `ssh.{name}`",
          example=example, doc=f"This spare's own `ssh.{name}`.")
      for name, type_, _default, example, _doc in _SSH),
    Key(path="master", type="mapping", default="the first node, port 29500",
        example="master: {addr: 192.168.1.10, port: auto}",
        doc="Where the rendezvous runs (always on the first node)."),
    Key(path="master.addr", type="hostname or IP address", default="the first node's `host`",
        example="addr: 192.168.1.10",
        doc="The address every node connects to for the rendezvous: the first node's address "
            "on the cluster network (not a loopback address when there are several nodes)."),
    Key(path="master.port", type="`auto` or a TCP port", default=str(DEFAULT_MASTER_PORT),
        example="port: auto",
        doc="The rendezvous port. `auto` (what `ptcluster init` writes): the first port of "
            "29500-29999 that is free and no other ptcluster job holds, chosen at launch, so "
            "jobs on the same nodes never collide."),
    Key(path="backend", type=" | ".join(BACKENDS), default="auto", example="backend: gloo",
        doc="The process group's backend: auto is NCCL when every rank has a GPU, else gloo."),
    *(Key(path=name, type=type_, default=default, example=example, doc=doc)
      for name, type_, default, example, doc in _PER_NODE),
    Key(path="env", type="mapping of name to string", default="none", example="env: {NCCL_DEBUG: "
        "WARN}", doc="Variables every rank gets. Nothing else of the head's environment is "
                     "shipped."),
    Key(path="warm", type="`true`, `false` or seconds (1-604800)", default="false",
        example="warm: 900",
        doc="Ranks start from warm interpreters, as with `run --warm`: each node keeps a pool "
            "of yours that has imported torch (and `warm_imports`), so a re-run, even of an "
            "edited script, skips the interpreter's start and `import torch`, with the output "
            "and exit code of a cold run. A number is the pool's idle timeout in seconds "
            "(`true`: 600); `ptcluster warm stop` ends pools sooner."),
    Key(path="warm_imports", type="list of module names", default="none (torch only)",
        example="warm_imports: [numpy, transformers]",
        doc="Modules a warm pool imports besides torch (installed libraries, never your "
            "project's code: an edit must take effect). Part of the pool's key."),
    Key(path="requirements", type="path", default="none (the ranks run in setup's interpreter)",
        example="requirements: uv.lock",
        doc="The project's own Python environment: a `uv.lock`, a `pylock.toml`, a "
            "`requirements*.txt` or a `pyproject.toml` (its `[project] dependencies`), relative "
            "to the cluster file's folder. Resolved once on the head into exact wheels, shipped "
            "to every node that lacks them and built there beside setup's torch; the ranks run "
            "in it. `run --requirements` wins over it. A file that names another index, or a "
            "package that must be built from source, needs `--trust-cluster-file`."),
    Key(path="find_links", type="list of paths", default="none (the package index)",
        example="find_links: [wheels/]",
        doc="Folders of wheels the head resolves `requirements` from instead of a package "
            "index (a head without Internet), relative to the cluster file's folder; "
            "`--find-links` adds to them."),
    Key(path="data", type="list of mappings", default="none",
        example="data: [{name: train, src: data/train, dest: /data/train}]",
        doc="Folders of the head's that `ptcluster run` pushes to every node before launch "
            "(as `ptcluster push` does: only what a node lacks, every file verified); each "
            "rank gets `PTCLUSTER_DATA_<NAME>` (the first entry also as `PTCLUSTER_DATA`). It "
            "sends the head's files to the hosts the file names: only with "
            "`--trust-cluster-file`."),
    Key(path="data[].name", type="letters, digits and `_`", default="(required)",
        example="name: train", doc="The entry's name: its variable is `PTCLUSTER_DATA_<NAME>` "
                                   "(upper-cased)."),
    Key(path="data[].src", type="path", default="(required)", example="src: data/train",
        doc="The folder on the head, relative to the cluster file's folder."),
    Key(path="data[].dest", type="absolute path", default="`src`'s absolute path",
        example="dest: /data/train", doc="The folder on every node (made if missing)."),
    Key(path="ssh", type="mapping", default="ssh's own settings",
        example="ssh: {user: ubuntu, reuse: 60}",
        doc="How the head reaches the nodes with the OpenSSH client; `~/.ssh/config` applies."),
    *(Key(path=f"ssh.{name}", type=type_, default=default, example=example, doc=doc)
      for name, type_, default, example, doc in _SSH),
    *(Key(path=f"nodes[].ssh.{name}", type=type_, default=f"the cluster-wide `ssh.{name}`",
          example=example, doc=f"This node's own `ssh.{name}`.")
      for name, type_, _default, example, _doc in _SSH),
    Key(path="slurm", type="mapping (`{}` or `true`: the defaults)",
        default="none: `ptcluster setup` installs no Slurm (unless `setup --slurm`)",
        example="slurm: {controller: node2}",
        doc="`ptcluster setup` also makes the nodes a Slurm cluster: munge with one key, "
            "slurmctld on the controller, slurmd everywhere, `slurm.conf` and `gres.conf` from "
            "each node's facts, proven by a job."),
    Key(path="slurm.controller", type="a node's `host`", default="the first node",
        example="controller: node2", doc="The node that runs slurmctld."),
    Key(path="slurm.partitions", type="mapping of partition name to a list of node hosts",
        default="one partition `main` with every node",
        example="partitions: {main: [node2]}",
        doc="Slurm partitions and their nodes (the first is the default partition)."),
)


def keys_at(level: str) -> tuple[str, ...]:
    """The key names the loader accepts in the mapping at ``level`` (``""``: the top)."""
    return tuple(k.name for k in KEYS if k.level == level)
