"""What doctor reports: a :class:`Finding` (a check's status on a node, with its one
:class:`~ptcluster.errors.Problem`), and every warning and failure a check can report, declared
here with its code (``doctor.NAME``), check, status, text and fix: ``TABLE``.

A check finds a problem and says it by its entry, with the values by name
(``SHM_SMALL.at(host, total="0.06")``); what passed (or was skipped) is a ``plain`` finding, the
node's facts in words, with no code and no fix. The docs' page of doctor's checks is generated
from this table (``scripts/docs_reference.py``), and ``doctor --json`` gives each finding's code.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ptcluster.errors import Problem
from ptcluster.node.problems import Declared
from ptcluster.node.venv_problems import REBUILD


class Status(str, Enum):
    """A finding's status (a ``str`` enum: the table and ``--json`` show the value)."""

    OK = "ok"
    WARN = "warn"
    """Worth knowing; doctor still passes."""
    FAIL = "fail"
    """A job would fail or hang: doctor exits 1."""
    SKIP = "skip"
    """Not checked (the node was not probed)."""

    def __str__(self) -> str:
        return self.value


OK, WARN, FAIL, SKIP = Status.OK, Status.WARN, Status.FAIL, Status.SKIP


@dataclass(frozen=True)
class Finding:
    """One check's status on one node, and what it found: one :class:`Problem` (who: the
    host; its code for a declared warning or failure)."""

    check: str
    status: Status
    problem: Problem

    @classmethod
    def plain(cls, check: str, host: str, status: Status, detail: str,
              fix: str | None = None) -> Finding:
        """A finding said in words only (what passed, what was skipped): no code."""
        return cls(check, status, Problem(host, detail, fix))

    @property
    def host(self) -> str:
        return str(self.problem.who)

    @property
    def detail(self) -> str:
        return self.problem.what

    @property
    def fix(self) -> str | None:
        return self.problem.fix

    @property
    def code(self) -> str | None:
        return self.problem.code

    @property
    def fields(self) -> dict[str, str]:
        """The values its entry's text was filled with (``{}``: a plain finding)."""
        return self.problem.fields

    def line(self) -> str:
        return str(self.problem)

    def to_json(self) -> dict[str, Any]:
        """``doctor --json``'s finding: check, host, status, detail, fix, and its code and
        fields (a declared one's)."""
        return {"check": self.check, "host": self.host, "status": self.status,
                "detail": self.detail, "fix": self.fix, "code": self.code,
                "fields": self.fields}


@dataclass(frozen=True, kw_only=True)
class FindingDef(Declared):
    """A warning or failure a doctor check reports: its entry, and which check and status."""

    check: str
    status: Status

    def at(self, host: str, /, **values: object) -> Finding:
        return Finding(self.check, self.status, Problem.of(self, host, **values))

    def of(self, problem: Problem) -> Finding:
        """A problem said elsewhere (a node's health gate, the channel's diagnosis), shown
        under this entry's check and status; its own code stays."""
        return Finding(self.check, self.status, problem)


def _d(code: str, check: str, status: Status, title: str, what: str, fix: str) -> FindingDef:
    return FindingDef(code=f"doctor.{code}", check=check, status=status, title=title, what=what,
                      fix=fix)


NO_ANSWER = _d("no-answer", "ssh", FAIL, "the node did not answer", "no answer",
               "check that the node is up and that `ssh NODE true` works from here")
PYTHON_FAILED = _d("python-failed", "python", FAIL, "the node's python failed",
                   "python failed", "set python: to an interpreter that runs there")
WORKDIR_MISSING = _d("workdir-missing", "workdir", FAIL, "workdir missing",
                     "workdir {path} does not exist",
                     "create it (or share it) on this node, or set workdir:")
WORKDIR_READONLY = _d("workdir-readonly", "workdir", WARN, "workdir not writable",
                      "workdir {path} is not writable",
                      "checkpoints and logs written there will fail; fix its permissions")
TORCH_MISSING = _d("torch-missing", "versions", FAIL, "torch not found",
                   "torch not found with {python}: {error}",
                   "install the same torch build as on the other nodes into that python")
VERSIONS_DIFFER = _d("versions-differ", "versions", FAIL, "versions differ between nodes",
                     "differs from the cluster: {diffs}",
                     "install identical Python/torch builds on every node (mismatched NCCL "
                     "versions hang or crash collectives)")
VERSIONS_UNKNOWN = _d("versions-unknown", "versions", WARN, "a version could not be told",
                      "could not tell {told}",
                      "compare by hand: {python} -c 'import torch; print(torch.__version__, "
                      "torch.version.cuda, torch.cuda.nccl.version())'")
NCCL_WITHOUT_GPU = _d("nccl-without-gpu", "gpus", FAIL, "backend nccl on a node without GPU",
                      "no NVIDIA GPU{why}, but backend: nccl",
                      "use backend: auto or gloo on CPU-only nodes")
NO_GPU_FOUND = _d("no-gpu-found", "gpus", WARN, "no GPU found, the query failed",
                  "no GPU found ({error})",
                  "check the NVIDIA driver (nvidia-smi); on a CPU-only node, ignore this")
DRIVER_TOO_OLD = _d("driver-too-old", "gpus", FAIL, "the driver is too old for torch's CUDA",
                    "driver {driver} is too old for torch's CUDA {cuda} (needs >= {need})",
                    "upgrade the NVIDIA driver, or install a torch build for an older CUDA")
DRIVER_CUDA_OLDER = _d("driver-cuda-older", "gpus", FAIL,
                       "the driver runs an older CUDA than torch's",
                       "driver {driver} runs CUDA up to {cuda_driver}, torch is built for CUDA "
                       "{cuda}",
                       "upgrade the NVIDIA driver, or install a torch build for an older CUDA")
TORCH_CPU_BUILD = _d("torch-cpu-build", "gpus", FAIL, "GPUs, but a CPU build of torch",
                     "{count} GPU(s) but torch {version} is a CPU build",
                     "install a CUDA build of torch that matches the driver")
GPUS_FEWER = _d("gpus-fewer-than-slots", "gpus", FAIL, "fewer GPUs than slots",
                "{count} GPU(s) for {slots} slots", "set slots: {count} for this node")
GPUS_UNUSED = _d("gpus-unused", "gpus", WARN, "GPUs left unused",
                 "{count} GPUs, only {slots} used (slots)", "set slots: {count} to use them all")
GPU_QUERY_FAILED = _d("gpu-query-failed", "gpus", WARN, "the GPU query failed",
                      "{count} GPU(s) found, then the query failed: {error}",
                      "check the NVIDIA driver (nvidia-smi -q)")
INTERFACES_UNLISTED = _d("interfaces-unlisted", "interface", FAIL, "interfaces not listed",
                         "could not list interfaces: {error}",
                         "install iproute2 with JSON output on this node (doctor reads `ip -j "
                         "addr show`)")
INTERFACE_MISSING = _d("interface-missing", "interface", FAIL, "the interface set is not there",
                       "interface {interface} not found (has: {names})",
                       "set interface: to one of {choices} for this node")
NO_ROUTE_TO_MASTER = _d("no-route-to-master", "interface", FAIL, "no route to the master",
                        "no route to the master {master}",
                        "check the master address resolves and is routable here")
INTERFACE_DOWN = _d("interface-down", "interface", FAIL, "the interface is down",
                    "interface {interface} is down",
                    "bring it up (ip link set {interface} up) or choose another")
INTERFACE_NO_IPV4 = _d("interface-no-ipv4", "interface", FAIL, "the interface has no IPv4",
                       "interface {interface} has no IPv4 address",
                       "give it an address on the cluster subnet")
ROUTES_ELSEWHERE = _d("routes-elsewhere", "interface", FAIL,
                      "peers are reached through another interface",
                      "traffic to {routes}, not {interface}",
                      "set interface: {other} for this node, or fix the routes so peers are "
                      "reached through one interface")
OTHER_SUBNET = _d("other-subnet", "interface", WARN, "nodes on different subnets",
                  "{address} is not in {first}'s subnet {network}",
                  "put all nodes' interfaces on one subnet, or check the interface choice")
HOSTNAME_LOOPBACK = _d("hostname-loopback", "hostname", FAIL, "the hostname resolves to loopback",
                       "hostname {hostname} resolves to {loopback} (loopback): gloo binds there "
                       "and peers cannot connect",
                       "in /etc/hosts map {hostname} to {address}, not {loopback}")
MASTER_UNRESOLVED = _d("master-unresolved", "hostname", FAIL, "the master does not resolve",
                       "cannot resolve the master address {master}",
                       "add it to /etc/hosts or DNS on this node, or use an IP address")
PEERS_RESOLVE_APART = _d("peers-resolve-apart", "hostname", WARN,
                         "nodes resolve each other differently", "resolves {peers}",
                         "make /etc/hosts or DNS agree on every node")
MASTER_PORT_IN_USE = _d("master-port-in-use", "master port", FAIL, "the master port is taken",
                        "master port is already in use on the master ({error})",
                        "set master.port: auto (every job takes a free port), or pass --port "
                        "with a free port")
MASTER_PORT_UNREACHABLE = _d("master-port-unreachable", "master port", FAIL,
                             "the master port cannot be reached",
                             "cannot connect to the master {master}:{port} ({error})",
                             "open TCP port {port} on the master to the cluster subnet "
                             "(firewall), or pick another port")
MASTER_PORT_EPHEMERAL = _d("master-port-ephemeral", "master port", WARN,
                           "the master port is in the ephemeral range",
                           "{master}:{port} reachable ({ms} ms), but inside ip_local_port_range "
                           "{low}-{high}: an outgoing connection may take it first",
                           "choose a master port below the ephemeral range")
PEER_PORT_UNREACHABLE = _d("peer-port-unreachable", "ports", FAIL, "a peer's port is closed",
                           "cannot reach {peer} on {host}:{port} ({error}){more}",
                           "allow TCP between cluster nodes on all ports (NCCL and Gloo use "
                           "ephemeral ports), at least from the cluster subnet")
SHM_SMALL = _d("shm-small", "resources", WARN, "/dev/shm is small",
               "shared memory (/dev/shm) only {total} GiB in all",
               "enlarge /dev/shm (docker: --shm-size=8g; or remount tmpfs)")
WORKDIR_DISK_LOW = _d("workdir-disk-low", "resources", WARN, "little free disk in the workdir",
                      "only {free} GiB free on the workdir's disk",
                      "free disk space in workdir for checkpoints and logs")
CLOCK_SKEW = _d("clock-skew", "clock", WARN, "the clock is off",
                "clock {offset} s from the cluster's median",
                "run NTP (chrony/systemd-timesyncd): skewed clocks scramble logs and timeouts")
SLOW = _d("slow-node", "compute", WARN, "a slow node",
               "slow node: probe {seconds} s, {ratio}x the other nodes' median ({median} s)",
               "every rank of a job waits for this node at each collective: look for a CPU "
               "quota or a busy CPU (top), a throttled or busy GPU (nvidia-smi -q -d "
               "PERFORMANCE, CLOCK), or another job on it")
ALLREDUCE_WRONG = _d("allreduce-wrong", "all-reduce", FAIL, "the all-reduce's result is wrong",
                     "{wrong} wrong elements in the all-reduce result",
                     "check GPUs/NICs for faults (dmesg, nvidia-smi -q) and that NCCL versions "
                     "match")
ALLREDUCE_FAILED = _d("allreduce-failed", "all-reduce", FAIL, "the all-reduce failed",
                      "all-reduce failed: {detail}",
                      "see the failures above and the logs in {run_dir}; run with "
                      "NCCL_DEBUG=INFO in env: for details")
HEALTH_REFUSED = _d("health-refused", "health", FAIL, "run would refuse the node",
                    "run would refuse it: {reasons}",
                    "see the health gate's refusals (`health.*`) for each reason's fix")
"""Only a fallback: doctor shows each refusal of the health gate by its own code
(``node.facts.health.TABLE``); this one when a node says no code (an older node program)."""
GPU_WORN = _d("gpu-worn", "gpu-health", WARN, "a GPU wears or runs slow", "{warnings}",
              "see `nvidia-smi -q` on it; a GPU whose link or clocks stay low needs its slot, "
              "cooling or power looked at")
"""Only a fallback, like ``HEALTH_REFUSED``: each warning has its code (``node.facts.health``)."""
SLURM_TOO_FEW_CPUS = _d("slurm-too-few-cpus", "slurm cpus", FAIL, "too few CPUs for the ranks",
                        "{slots} ranks may use only {usable} CPU(s) ({where})",
                        "ask Slurm for at least one CPU per rank (--cpus-per-task or "
                        "--exclusive), and do not bind the step (--cpu-bind=none)")
SLURM_CPUS_NARROWED = _d("slurm-cpus-narrowed", "slurm cpus", WARN,
                         "the step may use fewer CPUs than the job has",
                         "the ranks may use {usable} of the {asked} CPUs the job has here "
                         "({where}): a binding plugin narrowed the step",
                         "check TaskPlugin / --cpu-bind; every rank shares these CPUs")
SLURM_GPUS_HIDDEN = _d("slurm-gpus-hidden", "slurm gpus", FAIL, "the ranks see too few GPUs",
                       "{slots} ranks see {visible} GPU(s) ({shown}; {present} on the node)",
                       "ask for --gpus-per-node (not --gpus-per-task, which hides the peers' "
                       "GPUs), or run fewer ranks (--nproc)")
ENVIRONMENT_DIFFERS = _d("environment-differs", "environment", FAIL,
                         "the project's environment differs",
                         "{difference} (each said by its own `venvs.*` code: see below)",
                         REBUILD)
RDMA_NO_ACTIVE_PORT = _d("rdma-no-active-port", "rdma", FAIL, "RDMA devices but no ACTIVE port",
                         "RDMA devices but no ACTIVE port ({ports}): NCCL will use TCP sockets",
                         "connect the port and check the link (`ibstat`; InfiniBand needs a "
                         "subnet manager, e.g. opensm; RoCE needs its netdev up), or set "
                         "NCCL_IB_DISABLE: 1 in env: to use sockets knowingly")
RDMA_HCA_NOT_ACTIVE = _d("rdma-hca-not-active", "rdma", FAIL, "NCCL_IB_HCA names a port not up",
                         "NCCL_IB_HCA in env: names {down}, not ACTIVE",
                         "name an ACTIVE HCA port in NCCL_IB_HCA, or leave it out of env: (run "
                         "then sets this node's ACTIVE ports)")
RDMA_LINK_LOCAL_GID = _d("rdma-link-local-gid", "rdma", FAIL, "only link-local RoCE v2 GIDs",
                         "{ports}: only link-local (fe80::) GIDs for RoCE v2, which are not "
                         "routed: RDMA traffic times out",
                         "give the HCA's netdev an IP address on the cluster's RDMA network "
                         "(the kernel adds its RoCE v2 GID), then run doctor again")
RDMA_GID_INDEX_WRONG = _d("rdma-gid-index-wrong", "rdma", FAIL,
                          "NCCL_IB_GID_INDEX does not fit the node",
                          "NCCL_IB_GID_INDEX {index} (env:) does not fit: {wrong}",
                          "leave NCCL_IB_GID_INDEX out of env: (run sets each node's own), or "
                          "make the nodes' GID tables alike (show_gids)")
RDMA_GID_INDEX_DIFFERS = _d("rdma-gid-index-differs", "rdma", WARN,
                            "the GID index differs between a node's HCAs",
                            "the routable RoCE v2 GID has different indexes on this node's HCAs "
                            "({indexes}); NCCL takes one NCCL_IB_GID_INDEX for all",
                            "give every RDMA netdev its addresses in the same order, or name in "
                            "NCCL_IB_HCA only the HCAs that share one index")
RDMA_LINK_LAYERS_DIFFER = _d("rdma-link-layers-differ", "rdma", FAIL,
                             "InfiniBand and Ethernet in one job",
                             "its RDMA ports are {layer}, other nodes' {common}: NCCL cannot "
                             "connect InfiniBand to Ethernet (RoCE)",
                             "run the job on nodes of one fabric, or name one fabric's HCAs in "
                             "NCCL_IB_HCA")
RDMA_GID_INDEX_ACROSS = _d("rdma-gid-index-across", "rdma", WARN,
                           "the GID index differs between nodes",
                           "its routable RoCE v2 GID is index {index}, other nodes' {common}: "
                           "one NCCL_IB_GID_INDEX for all would fail here",
                           "keep NCCL_IB_GID_INDEX out of env: and /etc/nccl.conf (run sets "
                           "each node's own), or make the nodes' GID tables alike")

TABLE: tuple[FindingDef, ...] = tuple(v for v in list(globals().values())
                                      if isinstance(v, FindingDef))
"""Every warning and failure doctor's checks declare, in the order the checks run."""
