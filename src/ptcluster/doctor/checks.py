"""Checks: pure functions of the spec and every node's probe -> findings (ok / warn / fail + fix).

Each check is a failure users really hit when they run PyTorch across machines. No I/O here:
the tests feed recorded facts straight in.
"""

from __future__ import annotations

import ipaddress
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ptcluster.cluster.model import ClusterSpec, NodeSpec, Reach
from ptcluster.doctor.node_report import NodeReport, ProblemKind, address_of, interface_of
from ptcluster.errors import Problem


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
GIB = 1 << 30

# Oldest Linux driver that runs a CUDA major version (NVIDIA's CUDA compatibility guide, "minor
# version compatibility": 11.x needs >= 450.80.02, 12.x >= 525.60.13, 13.x >= 580.65.06).
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}


@dataclass(frozen=True)
class Finding:
    check: str
    host: str
    status: Status
    detail: str
    fix: str | None = None

    @property
    def problem(self) -> Problem:
        """This finding as the one :class:`Problem` (who: host, what: ``detail``, its fix)."""
        return Problem(self.host, self.detail, self.fix)

    def line(self) -> str:
        return str(self.problem)


Check = Callable[[ClusterSpec, dict[str, NodeReport]], list[Finding]]


def per_node(spec: ClusterSpec, probes: dict[str, NodeReport], name: str,
             fn: Callable[[NodeSpec, dict[str, Any]], Finding | None]) -> list[Finding]:
    """Check ``name`` on every node by its own facts (``fn`` -> a finding or none); a node
    that was not probed is a skip. The shape of every single-node check."""
    out = []
    for node in spec.nodes:
        facts = probes[node.host].facts
        if facts is None:
            out.append(Finding(name, node.host, SKIP, "no facts (node not probed)"))
            continue
        found = fn(node, facts)
        if found is not None:
            out.append(found)
    return out


def check_ssh(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    out = []
    for node in spec.nodes:
        p = probes[node.host]
        how = {Reach.LOCAL: "local", Reach.SSH: "BatchMode ssh",
               Reach.SRUN: f"srun step in job {spec.slurm_job}"}[spec.reach]
        if p.ok:
            out.append(Finding("ssh", node.host, OK, f"{how} ok, facts in {p.ssh_s:.2f} s"))
        elif p.kind is ProblemKind.PYTHON:
            out.append(Finding("ssh", node.host, OK, f"{how} ok (the command failed)"))
        else:
            said = p.problem or Problem(None, "no answer")
            out.append(Finding("ssh", node.host, FAIL, said.what, said.fix))
    return out


def check_python(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    out = []
    for node in spec.nodes:
        p = probes[node.host]
        if p.ok and p.facts is not None:
            out.append(Finding("python", node.host, OK,
                               f"{node.python} (Python {p.facts['python']['version']})"))
        elif p.kind is ProblemKind.PYTHON:
            said = p.problem or Problem(None, "python failed")
            out.append(Finding("python", node.host, FAIL, said.what, said.fix))
        else:
            out.append(Finding("python", node.host, SKIP, "node not reached"))
    return out


def check_workdir(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    def one(node: NodeSpec, facts: dict[str, Any]) -> Finding:
        wd = facts["workdir"]
        if not wd["exists"]:
            return Finding("workdir", node.host, FAIL, f"workdir {wd['path']} does not exist",
                           "create it (or share it) on this node, or set workdir:")
        if not wd["writable"]:
            return Finding("workdir", node.host, WARN, f"workdir {wd['path']} is not writable",
                           "checkpoints and logs written there will fail; fix its permissions")
        return Finding("workdir", node.host, OK, wd["path"])
    return per_node(spec, probes, "workdir", one)


VERSION_KEYS = ("python", "torch", "cuda", "nccl")
"""What must be identical on every node (cuDNN is reported, not compared)."""


def _versions(facts: dict[str, Any]) -> dict[str, str | None]:
    t = facts.get("torch") or {}
    return {"python": facts["python"]["version"], "torch": t.get("version"),
            "cuda": t.get("cuda"), "nccl": t.get("nccl")}


def check_versions(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """torch installed everywhere; Python, torch, CUDA and NCCL versions identical on all nodes.

    A version the probe could not tell (``unknown``) is left out of the comparison and warned
    about; ``None`` is a real value (a CPU build has no CUDA and no NCCL)."""
    known: dict[str, Counter[str | None]] = {key: Counter() for key in VERSION_KEYS}
    for n in spec.nodes:
        facts = probes[n.host].facts
        t = (facts or {}).get("torch") or {}
        if facts is None or not t.get("ok"):
            continue
        for key, value in _versions(facts).items():
            if key not in (t.get("unknown") or {}):
                known[key][value] += 1
    majority = {key: c.most_common(1)[0][0] if c else None for key, c in known.items()}

    def one(node: NodeSpec, facts: dict[str, Any]) -> Finding:
        t = facts.get("torch") or {}
        if not t.get("ok"):
            return Finding("versions", node.host, FAIL,
                           f"torch not found with {node.python}: {t.get('error')}",
                           "install the same torch build as on the other nodes into that python")
        unknown = {k: why for k, why in (t.get("unknown") or {}).items() if k in VERSION_KEYS}
        mine = _versions(facts)
        diffs = [f"{k} {mine[k]} (others: {majority[k]})" for k in VERSION_KEYS
                 if k not in unknown and mine[k] != majority[k]]
        if diffs:
            return Finding("versions", node.host, FAIL, "differs from the cluster: " +
                           ", ".join(diffs),
                           "install identical Python/torch builds on every node "
                           "(mismatched NCCL versions hang or crash collectives)")
        if unknown:
            told = "; ".join(f"{k} ({why})" for k, why in unknown.items())
            return Finding("versions", node.host, WARN, f"could not tell {told}",
                           f"compare by hand: {node.python} -c 'import torch; "
                           "print(torch.__version__, torch.version.cuda, "
                           "torch.cuda.nccl.version())'")
        text = f"torch {mine['torch']}" + (f", CUDA {mine['cuda']}" if mine["cuda"] else ", CPU")
        if mine["nccl"]:
            text += f", NCCL {mine['nccl']}"
        if t.get("cudnn"):
            text += f", cuDNN {t['cudnn']}"
        return Finding("versions", node.host, OK, text + f", Python {mine['python']}")
    return per_node(spec, probes, "versions", one)


def _parse_version(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_gpus(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """Driver new enough for torch's CUDA; GPU count >= slots when GPUs are to be used."""
    def one(node: NodeSpec, facts: dict[str, Any]) -> Finding:
        g = facts["gpus"]
        t = facts.get("torch") or {}
        count = g["count"]
        if count == 0:
            why = f" ({g['error']})" if g.get("error") else ""
            if spec.backend == "nccl":
                return Finding("gpus", node.host, FAIL, f"no NVIDIA GPU{why}, but backend: nccl",
                               "use backend: auto or gloo on CPU-only nodes")
            if why:
                return Finding("gpus", node.host, WARN, f"no GPU found{why}",
                               "check the NVIDIA driver (nvidia-smi); on a CPU-only node, "
                               "ignore this")
            return Finding("gpus", node.host, OK, "no GPU: gloo on CPU")
        cuda = t.get("cuda")
        if cuda and g.get("driver"):
            major = _parse_version(cuda)[0]
            need = MIN_DRIVER.get(major)
            if need and _parse_version(g["driver"]) < need:
                return Finding("gpus", node.host, FAIL,
                               f"driver {g['driver']} is too old for torch's CUDA {cuda} "
                               f"(needs >= {need[0]}.{need[1]:02d}.{need[2]:02d})",
                               "upgrade the NVIDIA driver, or install a torch build for an "
                               "older CUDA")
            if need is None and g.get("cuda_driver") and \
                    _parse_version(g["cuda_driver"])[0] < major:
                return Finding("gpus", node.host, FAIL,
                               f"driver {g['driver']} runs CUDA up to {g['cuda_driver']}, "
                               f"torch is built for CUDA {cuda}",
                               "upgrade the NVIDIA driver, or install a torch build for an "
                               "older CUDA")
        if t.get("ok") and cuda is None and "cuda" not in (t.get("unknown") or {}):
            return Finding("gpus", node.host, FAIL,
                           f"{count} GPU(s) but torch {t.get('version')} is a CPU build",
                           "install a CUDA build of torch that matches the driver")
        if count < node.slots and spec.backend != "gloo":
            return Finding("gpus", node.host, FAIL, f"{count} GPU(s) for {node.slots} slots",
                           f"set slots: {count} for this node")
        if count > node.slots:
            return Finding("gpus", node.host, WARN,
                           f"{count} GPUs, only {node.slots} used (slots)",
                           f"set slots: {count} to use them all")
        if g.get("error"):
            return Finding("gpus", node.host, WARN,
                           f"{count} GPU(s) found, then the query failed: {g['error']}",
                           "check the NVIDIA driver (nvidia-smi -q)")
        return Finding("gpus", node.host, OK, f"{count} x {g['names'][0]}, driver {g['driver']}")
    return per_node(spec, probes, "gpus", one)


def check_interface(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """The interface exists, is up, has IPv4; nodes share a subnet; routes to peers use it."""
    nets: dict[str, ipaddress.IPv4Interface | ipaddress.IPv6Interface] = {}
    out: list[Finding] = []
    for node in spec.nodes:
        facts = probes[node.host].facts
        if facts is None:
            out.append(Finding("interface", node.host, SKIP, "no facts"))
            continue
        if facts.get("interfaces_error"):
            out.append(Finding("interface", node.host, FAIL,
                               f"could not list interfaces: {facts['interfaces_error']}",
                               "install iproute2 with JSON output on this node (doctor reads "
                               "`ip -j addr show`)"))
            continue
        names = [i["name"] for i in facts["interfaces"]]
        iface = interface_of(node, facts, spec.master.addr)
        entry = next((i for i in facts["interfaces"] if i["name"] == iface), None)
        if entry is None:
            if node.interface:
                out.append(Finding("interface", node.host, FAIL,
                                   f"interface {node.interface} not found (has: "
                                   f"{', '.join(names)})",
                                   "set interface: to one of "
                                   f"{', '.join(n for n in names if n != 'lo')} for this node"))
            else:
                out.append(Finding("interface", node.host, FAIL,
                                   f"no route to the master {spec.master.addr}",
                                   "check the master address resolves and is routable here"))
            continue
        if not entry["up"]:
            out.append(Finding("interface", node.host, FAIL, f"interface {iface} is down",
                               f"bring it up (ip link set {iface} up) or choose another"))
            continue
        if not entry["ipv4"]:
            out.append(Finding("interface", node.host, FAIL, f"interface {iface} has no IPv4 "
                               "address", "give it an address on the cluster subnet"))
            continue
        nets[node.host] = ipaddress.ip_interface(entry["ipv4"][0])
        wrong = [(peer, info["route_dev"]) for peer, info in facts["peers"].items()
                 if info.get("route_dev") not in (None, iface, "lo")]
        if wrong and not spec.local:
            out.append(Finding("interface", node.host, FAIL,
                               f"traffic to {', '.join(f'{p} via {d}' for p, d in wrong)}, "
                               f"not {iface}",
                               f"set interface: {wrong[0][1]} for this node, or "
                               "fix the routes so peers are reached through one interface"))
            continue
        how = "set" if node.interface else "detected"
        out.append(Finding("interface", node.host, OK, f"{iface} ({how}) {entry['ipv4'][0]}"))
    if len(nets) > 1:
        first_host, first = next(iter(nets.items()))
        apart = {host: addr for host, addr in nets.items() if addr.ip not in first.network}
        out = [f for f in out if not (f.host in apart and f.status == OK)]  # (one pass)
        out += [Finding("interface", host, WARN,
                        f"{addr} is not in {first_host}'s subnet {first.network}",
                        "put all nodes' interfaces on one subnet, or check the interface "
                        "choice") for host, addr in apart.items()]
    return out


def check_hostname(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """The hostname does not resolve to loopback; nodes resolve each other consistently."""
    iface_addr = {}
    for node in spec.nodes:
        facts = probes[node.host].facts
        if facts:
            iface_addr[node.host] = address_of(interface_of(node, facts, spec.master.addr), facts)

    def one(node: NodeSpec, facts: dict[str, Any]) -> Finding:
        loop = [a for a in facts["hostname_addrs"] if a.startswith("127.")]
        if loop and not spec.local:
            return Finding("hostname", node.host, FAIL,
                           f"hostname {facts['hostname']} resolves to {loop[0]} (loopback): "
                           "gloo binds there and peers cannot connect",
                           f"in /etc/hosts map {facts['hostname']} to "
                           f"{iface_addr.get(node.host) or 'its cluster address'}, not {loop[0]}")
        bad = []
        master = facts.get("master") or {}
        if not master.get("addrs"):
            return Finding("hostname", node.host, FAIL,
                           f"cannot resolve the master address {spec.master.addr}",
                           "add it to /etc/hosts or DNS on this node, or use an IP address")
        for peer, info in facts["peers"].items():
            want = iface_addr.get(peer)
            if info["addrs"] and want and want not in info["addrs"] and \
                    not any(a.startswith("127.") for a in info["addrs"]):
                bad.append(f"{peer} -> {info['addrs'][0]} (its interface has {want})")
        if bad:
            return Finding("hostname", node.host, WARN, "resolves " + "; ".join(bad),
                           "make /etc/hosts or DNS agree on every node")
        return Finding("hostname", node.host, OK, f"{facts['hostname']} -> "
                       f"{', '.join(facts['hostname_addrs']) or 'unresolved'}")
    return per_node(spec, probes, "hostname", one)


def check_master_port(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    master = spec.nodes[0]
    mfacts = probes[master.host].facts
    out = []
    listening = (mfacts or {}).get("listening", {})
    if mfacts is not None and listening.get("master") is None:
        return [Finding("master port", master.host, FAIL,
                        f"master port is already in use on the master "
                        f"({listening.get('master_error')})",
                        "set master.port: auto (every job takes a free port), or pass --port "
                        "with a free port")]
    for node in spec.nodes:
        p = probes[node.host]
        if not p.ok or mfacts is None:
            out.append(Finding("master port", node.host, SKIP, "not probed"))
            continue
        res = next((c for c in p.connects if c["label"] == "master"), None)
        if res is None:
            out.append(Finding("master port", node.host, SKIP, "not tested"))
        elif res["error"]:
            out.append(Finding("master port", node.host, FAIL,
                               f"cannot connect to the master {spec.master.addr}:{res['port']} "
                               f"({res['error']})",
                               f"open TCP port {res['port']} on the master to the cluster subnet "
                               "(firewall), or pick another port"))
        else:
            text = f"{spec.master.addr}:{res['port']} reachable ({res['ms']:.0f} ms)"
            rng = mfacts.get("ephemeral_range")
            if node.host == master.host and rng and rng[0] <= res["port"] <= rng[1] \
                    and not spec.local:  # the local cluster picks a free port itself
                out.append(Finding("master port", node.host, WARN,
                                   f"{text}, but inside ip_local_port_range {rng[0]}-{rng[1]}: "
                                   "an outgoing connection may take it first",
                                   "choose a master port below the ephemeral range"))
            else:
                out.append(Finding("master port", node.host, OK, text))
    return out


def check_ports(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """Ephemeral TCP ports reachable between nodes (NCCL/Gloo do not use the master port only)."""
    out = []
    for node in spec.nodes:
        p = probes[node.host]
        if not p.ok:
            out.append(Finding("ports", node.host, SKIP, "not probed"))
            continue
        peers = [c for c in p.connects if c["label"].startswith("peer:")]
        failed = [c for c in peers if c["error"]]
        if failed:
            c = failed[0]
            out.append(Finding("ports", node.host, FAIL,
                               f"cannot reach {c['label'][5:]} on {c['host']}:{c['port']} "
                               f"({c['error']})" + (f" and {len(failed) - 1} more"
                                                    if len(failed) > 1 else ""),
                               "allow TCP between cluster nodes on all ports (NCCL and Gloo use "
                               "ephemeral ports), at least from the cluster subnet"))
        elif peers:
            out.append(Finding("ports", node.host, OK, f"{len(peers)} peer(s) reachable"))
        else:
            out.append(Finding("ports", node.host, OK, "single node"))
    return out


def check_firewall(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    def one(node: NodeSpec, facts: dict[str, Any]) -> Finding:
        fw = facts["firewall"]
        parts = []
        if "nft_rules" in fw:
            parts.append(f"nft {fw['nft_rules']} rule(s), {fw.get('nft_drop', 0)} drop/reject")
        if "iptables_rules" in fw:
            parts.append(f"iptables {fw['iptables_rules']} rule(s)")
        if fw.get("kind"):  # the firewall's model (node/facts/firewall.py, setup's too)
            parts.append(f"{fw['kind']} {'active' if fw.get('active') else 'inactive'}")
        return Finding("firewall", node.host, OK, "; ".join(parts) or "no firewall tool found")
    return per_node(spec, probes, "firewall", one)


def check_resources(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """/dev/shm (DataLoader workers and NCCL use it) and free disk in workdir."""
    def one(node: NodeSpec, facts: dict[str, Any]) -> Finding:
        shm, disk = facts.get("shm"), facts.get("disk")
        notes = []
        status = OK
        fix = None
        if shm is not None and shm["total"] < GIB:
            status, fix = WARN, "enlarge /dev/shm (docker: --shm-size=8g; or remount tmpfs)"
            notes.append(f"shared memory (/dev/shm) only {shm['total'] / GIB:.2f} GiB in all")
        elif shm is not None:
            notes.append(f"shared memory (/dev/shm) {shm['total'] / GIB:.1f} GiB in all")
        if disk is not None and disk["free"] < 5 * GIB:
            status, fix = WARN, fix or "free disk space in workdir for checkpoints and logs"
            notes.append(f"only {disk['free'] / GIB:.1f} GiB free on the workdir's disk")
        elif disk is not None:
            notes.append(f"{disk['free'] / GIB:.0f} GiB free on the workdir's disk")
        return Finding("resources", node.host, status, ", ".join(notes), fix)
    return per_node(spec, probes, "resources", one)


def check_clock(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    offsets = {h: p.clock_offset for h, p in probes.items() if p.clock_offset is not None}
    if not offsets:
        return []
    mid = statistics.median(offsets.values())
    out = []
    for node in spec.nodes:
        off = offsets.get(node.host)
        if off is None:
            out.append(Finding("clock", node.host, SKIP, "not probed"))
        elif abs(off - mid) > 1.0:
            out.append(Finding("clock", node.host, WARN,
                               f"clock {off - mid:+.1f} s from the cluster's median",
                               "run NTP (chrony/systemd-timesyncd): skewed clocks scramble "
                               "logs and timeouts"))
        else:
            out.append(Finding("clock", node.host, OK, f"{off - mid:+.2f} s"))
    return out


FAST_CHECKS: tuple[Check, ...] = (
    check_ssh, check_python, check_workdir, check_versions, check_gpus, check_interface,
    check_hostname, check_master_port, check_ports, check_firewall, check_resources,
    check_clock,
)


def run_checks(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    findings: list[Finding] = []
    for check in FAST_CHECKS:
        findings.extend(check(spec, probes))
    return findings
