"""The doctor's node-side probe: facts about one node as JSON (standard library first).

Shipped and started like the guard (source over the channel's stdin, see ``remote.bootstrap``).
One ssh session per node does everything:

  stdin  line 2   JSON config (``DoctorConfig``): workdir, peers, master_addr, master_port
                  (master only), ...
  stdout          frames of ``node.wire``: ``hello``, then ``ready {facts}`` (facts, plus the
                  ports this node now listens on)
  stdin           ``connect {"targets": [[label, host, port], ...], "timeout": s}``
                  (``ConnectAsk``)
  stdout          ``connect {"results": [...]}``
  stdin           EOF or ``bye``: close the listeners and exit

torch is never imported here (an import costs seconds per node): its versions come from its
package metadata and ``torch/version.py`` (parsed, never executed), the CUDA libraries' versions
from their wheels' metadata or file names, and GPUs from NVML through ctypes. Importing torch is
the all-reduce's job (``node/rank/allreduce.py``).

Version facts are ``None`` when the thing is not installed (a CPU build has no NCCL) and are
named in ``unknown`` (with the reason) when it is there but its version cannot be told.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import threading
import time
from typing import TypedDict

from ptcluster.node.facts.accel import GpuFacts, TorchFacts, gpus, sh, torch_facts
from ptcluster.node.facts.firewall import FirewallState, RuleCounts, firewall_state, rule_counts
from ptcluster.node.facts.health import HealthFinding, gpu_warnings, judge
from ptcluster.node.facts.health_facts import HealthContext, read_health
from ptcluster.node.facts.netif import (
    AUTO_PORTS,
    Interface,
    interfaces,
    route_dev,
    route_interface,
)
from ptcluster.node.facts.rdma import Device, read_rdma
from ptcluster.node.problems import Sent
from ptcluster.node.wire import Kind, encode, hello, split


class PythonFacts(TypedDict):
    executable: str
    version: str


class WorkdirFacts(TypedDict):
    path: str
    """The node's (``~`` expanded there)."""
    exists: bool
    writable: bool


class Route(TypedDict):
    """How this node reaches a name: its addresses and the interface of the route to the
    first (None: no route, or no address)."""

    addrs: list[str]
    route_dev: str | None


class MasterRoute(Route):
    interface: str | None
    """The interface the guard would give NCCL and Gloo (``netif.route_interface``)."""
    interface_error: str | None


class Space(TypedDict):
    """Bytes free to a user and in all of a filesystem."""

    free: int
    total: int


class Listening(TypedDict, total=False):
    """The ports this node listens on for the doctor's connect test."""

    master: int | None
    ephemeral: int | None
    master_error: str | None
    ephemeral_error: str


class SlurmStep(TypedDict, total=False):
    """What an srun step may use (``slurm_facts``; a reader takes none of it for granted: the
    head checks the section only as bounded JSON)."""

    affinity: list[int] | None
    cpus_on_node: str | None
    cuda_visible_devices: str | None
    gpus_on_node: str | None
    node: str | None


class DoctorFacts(TypedDict, total=False):
    """The ``ready`` frame of the doctor's facts program: ``collect``'s and ``listening``.
    The head checks it as it arrives (``remote.node_replies.doctor_reply``) and reads it as
    this (``doctor.node_report.NodeReport.facts``): a key renamed here is mypy's error there."""

    time: float
    """The node's clock when the facts were done (the head's clock offset)."""
    hostname: str
    hostname_addrs: list[str]
    python: PythonFacts
    workdir: WorkdirFacts
    peers: dict[str, Route]
    master: MasterRoute
    """Only where the config names ``master_addr``."""
    firewall: FirewallFacts
    gpus: GpuFacts
    """``facts.accel.gpus``."""
    rdma: list[Device]
    interfaces: list[Interface]
    """``facts.netif.interfaces``: ``[{name, up, ipv4}]``."""
    interfaces_error: str | None
    ephemeral_range: list[int] | None
    shm: Space | None
    disk: Space | None
    """The workdir's filesystem."""
    health: list[HealthFinding]
    """The health gate's findings (``facts.health.judge``)."""
    gpu_warnings: list[Sent]
    torch: TorchFacts | None
    """``facts.accel.torch_facts`` (None: not asked)."""
    slurm: SlurmStep | None
    listening: Listening


def resolve(name: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    out: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in out:
            out.append(addr)
    return out


class FirewallFacts(FirewallState, RuleCounts):
    """Doctor's ``firewall``: setup's model of it and the rule counts."""


def firewall() -> FirewallFacts:
    """The firewall's model (``node.facts.firewall``: setup's, read as root only when this is root)
    and the rule counts of nftables and iptables."""
    def run(argv: list[str]) -> tuple[int, str]:
        return sh(*argv)

    return {**firewall_state(run, run if os.geteuid() == 0 else None), **rule_counts(run)}


class _Config(TypedDict):
    workdir: str
    """``~`` is the node's home, as for the guard."""


class DoctorConfig(_Config, total=False):
    """The doctor's node program's config line (``doctor.collect.collect_facts`` writes it)."""

    peers: list[str]
    """The nodes whose names and routes this one checks (``doctor.collect.probe_peers``)."""
    master_addr: str
    slots: int
    backend: str
    gpus_chosen: bool
    """The cluster file names this node's GPUs (the health gate's context)."""
    master_port: int | str | None
    """Only the master's: the port it listens on for the connect test (``auto``: the first
    free one of ``AUTO_PORTS``)."""
    torch: bool
    """Read torch's facts (default true)."""


class ConnectAsk(TypedDict):
    """``connect``: what this node connects to (``doctor.collect`` writes it)."""

    targets: list[tuple[str, str, int]]
    """``[label, host, port]``: ``master``, or ``peer:HOST`` (its ephemeral listener)."""
    timeout: float


def collect(cfg: DoctorConfig) -> DoctorFacts:
    workdir = os.path.expanduser(cfg["workdir"])  # `~` is the node's home, as for the guard
    hostname = socket.gethostname()
    facts: DoctorFacts = {
        "time": time.time(),
        "hostname": hostname,
        "hostname_addrs": resolve(hostname),
        "python": {"executable": sys.executable, "version": platform.python_version()},
        "workdir": {"path": workdir, "exists": os.path.isdir(workdir),
                    "writable": os.access(workdir, os.W_OK)},
        "peers": {},
        "firewall": firewall(),
        "gpus": gpus(),
        "rdma": read_rdma(),
    }
    facts["interfaces"], facts["interfaces_error"] = interfaces()
    for peer in cfg.get("peers", []):
        addrs = resolve(peer)
        facts["peers"][peer] = {"addrs": addrs,
                                "route_dev": route_dev(addrs[0])[0] or None if addrs else None}
    master = cfg.get("master_addr")
    if master:
        addrs = resolve(master)
        iface, why = route_interface(master)  # the guard's own rule (node/facts/netif.py)
        facts["master"] = {"addrs": addrs,
                           "route_dev": route_dev(addrs[0])[0] or None if addrs else None,
                           "interface": iface, "interface_error": why}
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
        facts["ephemeral_range"] = [int(lo), int(hi)]
    except (OSError, ValueError):
        facts["ephemeral_range"] = None
    facts["shm"], facts["disk"] = space("/dev/shm"), space(workdir)
    ctx: HealthContext = {  # the guard's gate (node.facts.health), on the facts read above
        "workdir": workdir, "slots": cfg.get("slots"), "backend": cfg.get("backend"),
        "chosen": cfg.get("gpus_chosen") or "CUDA_VISIBLE_DEVICES" in os.environ,
        "gpu_count": int(facts["gpus"].get("count") or 0)}
    if disk := facts["disk"]:
        ctx["disk"] = (disk["free"], disk["total"])
    health = read_health(ctx)
    facts["health"] = judge(health)
    facts["gpu_warnings"] = gpu_warnings(health) if ctx["gpu_count"] else []
    facts["torch"] = torch_facts() if cfg.get("torch", True) else None
    facts["slurm"] = slurm_facts()
    facts["time"] = time.time()  # last: the head compares it with its clock on arrival
    return facts


def space(path: str) -> Space | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return {"free": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize}


def slurm_facts() -> SlurmStep | None:
    """Under an srun step (how ptcluster reaches an allocation's nodes): what the step may use.
    The ranks are the guard's children in the same kind of step, so they inherit the same."""
    if "SLURM_STEP_ID" not in os.environ:
        return None
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = None
    return {"affinity": cpus, "cpus_on_node": os.environ.get("SLURM_CPUS_ON_NODE"),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpus_on_node": os.environ.get("SLURM_GPUS_ON_NODE"),
            "node": os.environ.get("SLURMD_NODENAME")}


class Listener:
    """Accepts and closes connections on a port until the probe ends."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("", port))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()


class Connect(TypedDict):
    """One connection a node tried (the ``connect`` frame's ``results``; doctor's ports
    check reads them, ``NodeReport.connects``)."""

    label: str
    """``master``, or the peer whose ephemeral port it was."""
    host: str
    port: int
    error: str | None
    """Why it failed (None: it connected)."""
    ms: float


def connect_all(targets: list[tuple[str, str, int]], timeout: float) -> list[Connect]:
    results: list[Connect] = []
    lock = threading.Lock()

    def one(label: str, host: str, port: int) -> None:
        t0 = time.perf_counter()
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                err = None
        except OSError as exc:
            err = exc.strerror or str(exc) or type(exc).__name__
        with lock:
            results.append({"label": label, "host": host, "port": port, "error": err,
                            "ms": round((time.perf_counter() - t0) * 1000, 1)})

    threads = [threading.Thread(target=one, args=tuple(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def emit(frame: bytes) -> None:
    sys.stdout.buffer.write(frame)
    sys.stdout.flush()


def main() -> int:
    cfg: DoctorConfig = json.loads(sys.stdin.readline())
    emit(hello("facts"))
    facts = collect(cfg)
    listening: Listening = {"master": None, "ephemeral": None, "master_error": None}
    listeners = []
    for port in AUTO_PORTS if cfg.get("master_port") == "auto" else [cfg.get("master_port")]:
        if not port:
            break
        try:  # auto: the first free port of the range, as the guard takes at launch
            listeners.append(Listener(int(port)))
            listening["master"], listening["master_error"] = int(port), None
            break
        except OSError as exc:
            listening["master_error"] = exc.strerror or str(exc)
    try:
        eph = Listener(0)  # the kernel picks from ip_local_port_range, as NCCL/Gloo sockets do
        listeners.append(eph)
        listening["ephemeral"] = eph.port
    except OSError as exc:
        listening["ephemeral_error"] = str(exc)
    facts["listening"] = listening
    emit(encode(Kind.READY, facts))
    for line in sys.stdin:
        kind, payload = split(line.strip())
        if kind == Kind.CONNECT:
            request: ConnectAsk = json.loads(payload)
            emit(encode(Kind.CONNECT, {"results": connect_all(request["targets"],
                                                           float(request["timeout"]))}))
        elif kind != Kind.HB:
            break  # "bye", EOF or anything unknown: done
    for lst in listeners:
        lst.sock.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
