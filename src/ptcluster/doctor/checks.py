"""Checks: pure functions of the spec and every node's probe -> findings (ok / warn / fail + fix).

Each check is a failure users really hit when they run PyTorch across machines. No I/O here:
the tests feed recorded facts straight in.
"""

from __future__ import annotations

import ipaddress
import statistics
from collections import Counter
from collections.abc import Callable

from ptcluster.cluster.model import ClusterSpec, NodeSpec, Reach
from ptcluster.doctor import findings as F
from ptcluster.doctor.findings import FAIL, OK, SKIP, WARN, Finding, Status
from ptcluster.doctor.node_report import NodeReport, ProblemKind, address_of, interface_of
from ptcluster.node.doctor_facts import DoctorFacts
from ptcluster.node.facts.accel import no_torch

__all__ = ["FAIL", "OK", "SKIP", "WARN", "Finding", "Status", "per_node", "run_checks"]
GIB = 1 << 30

# Oldest Linux driver that runs a CUDA major version (NVIDIA's CUDA compatibility guide, "minor
# version compatibility": 11.x needs >= 450.80.02, 12.x >= 525.60.13, 13.x >= 580.65.06).
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}


Check = Callable[[ClusterSpec, dict[str, NodeReport]], list[Finding]]


def per_node(spec: ClusterSpec, probes: dict[str, NodeReport], name: str,
             fn: Callable[[NodeSpec, DoctorFacts], Finding | list[Finding] | None],
             ) -> list[Finding]:
    """Check ``name`` on every node by its own facts (``fn`` -> a finding, several, or none);
    a node that was not probed is a skip. The shape of every single-node check."""
    out = []
    for node in spec.nodes:
        facts = probes[node.host].facts
        if facts is None:
            out.append(Finding.plain(name, node.host, SKIP, "no facts (node not probed)"))
            continue
        found = fn(node, facts)
        out.extend([] if found is None else [found] if isinstance(found, Finding) else found)
    return out


def check_ssh(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    out = []
    for node in spec.nodes:
        p = probes[node.host]
        how = {Reach.LOCAL: "local", Reach.SSH: "BatchMode ssh",
               Reach.SRUN: f"srun step in job {spec.slurm_job}"}[spec.reach]
        if p.ok:
            out.append(Finding.plain("ssh", node.host, OK, f"{how} ok, facts in {p.ssh_s:.2f} s"))
        elif p.kind is ProblemKind.PYTHON:
            out.append(Finding.plain("ssh", node.host, OK, f"{how} ok (the command failed)"))
        else:
            out.append(F.NO_ANSWER.of(p.problem.by(node.host)) if p.problem
                       else F.NO_ANSWER.at(node.host))
    return out


def check_python(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    out = []
    for node in spec.nodes:
        p = probes[node.host]
        if p.ok and p.facts is not None:
            out.append(Finding.plain("python", node.host, OK,
                               f"{node.python} (Python {p.facts['python']['version']})"))
        elif p.kind is ProblemKind.PYTHON:
            out.append(F.PYTHON_FAILED.of(p.problem.by(node.host)) if p.problem
                       else F.PYTHON_FAILED.at(node.host))
        else:
            out.append(Finding.plain("python", node.host, SKIP, "node not reached"))
    return out


def check_workdir(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    def one(node: NodeSpec, facts: DoctorFacts) -> Finding:
        wd = facts["workdir"]
        if not wd["exists"]:
            return F.WORKDIR_MISSING.at(node.host, path=wd["path"])
        if not wd["writable"]:
            return F.WORKDIR_READONLY.at(node.host, path=wd["path"])
        return Finding.plain("workdir", node.host, OK, wd["path"])
    return per_node(spec, probes, "workdir", one)


VERSION_KEYS = ("python", "torch", "cuda", "nccl")
"""What must be identical on every node (cuDNN is reported, not compared)."""


def _versions(facts: DoctorFacts) -> dict[str, str | None]:
    t = facts.get("torch") or no_torch()
    return {"python": facts["python"]["version"], "torch": t.get("version"),
            "cuda": t.get("cuda"), "nccl": t.get("nccl")}


def check_versions(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """torch installed everywhere; Python, torch, CUDA and NCCL versions identical on all nodes.

    A version the probe could not tell (``unknown``) is left out of the comparison and warned
    about; ``None`` is a real value (a CPU build has no CUDA and no NCCL)."""
    known: dict[str, Counter[str | None]] = {key: Counter() for key in VERSION_KEYS}
    for n in spec.nodes:
        facts = probes[n.host].facts
        if facts is None or not (t := facts.get("torch") or no_torch())["ok"]:
            continue
        for key, value in _versions(facts).items():
            if key not in (t.get("unknown") or {}):
                known[key][value] += 1
    majority = {key: c.most_common(1)[0][0] if c else None for key, c in known.items()}

    def one(node: NodeSpec, facts: DoctorFacts) -> Finding:
        t = facts.get("torch") or no_torch()
        if not t.get("ok"):
            return F.TORCH_MISSING.at(node.host, python=node.python, error=t.get("error"))
        unknown = {k: why for k, why in (t.get("unknown") or {}).items() if k in VERSION_KEYS}
        mine = _versions(facts)
        diffs = [f"{k} {mine[k]} (others: {majority[k]})" for k in VERSION_KEYS
                 if k not in unknown and mine[k] != majority[k]]
        if diffs:
            return F.VERSIONS_DIFFER.at(node.host, diffs=", ".join(diffs))
        if unknown:
            told = "; ".join(f"{k} ({why})" for k, why in unknown.items())
            return F.VERSIONS_UNKNOWN.at(node.host, told=told, python=node.python)
        text = f"torch {mine['torch']}" + (f", CUDA {mine['cuda']}" if mine["cuda"] else ", CPU")
        if mine["nccl"]:
            text += f", NCCL {mine['nccl']}"
        if t.get("cudnn"):
            text += f", cuDNN {t['cudnn']}"
        return Finding.plain("versions", node.host, OK, text + f", Python {mine['python']}")
    return per_node(spec, probes, "versions", one)


def _parse_version(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_gpus(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """Driver new enough for torch's CUDA; GPU count >= slots when GPUs are to be used."""
    def one(node: NodeSpec, facts: DoctorFacts) -> Finding:
        g = facts["gpus"]
        t = facts.get("torch") or no_torch()
        count = g["count"]
        if count == 0:
            why = f" ({g['error']})" if g.get("error") else ""
            if spec.backend == "nccl":
                return F.NCCL_WITHOUT_GPU.at(node.host, why=why)
            if why:
                return F.NO_GPU_FOUND.at(node.host, error=g["error"])
            return Finding.plain("gpus", node.host, OK, "no GPU: gloo on CPU")
        cuda, driver, cuda_driver = t.get("cuda"), g.get("driver"), g.get("cuda_driver")
        if cuda and driver:
            major = _parse_version(cuda)[0]
            need = MIN_DRIVER.get(major)
            if need and _parse_version(driver) < need:
                return F.DRIVER_TOO_OLD.at(node.host, driver=driver, cuda=cuda,
                                           need=f"{need[0]}.{need[1]:02d}.{need[2]:02d}")
            if need is None and cuda_driver and _parse_version(cuda_driver)[0] < major:
                return F.DRIVER_CUDA_OLDER.at(node.host, driver=driver, cuda=cuda,
                                              cuda_driver=cuda_driver)
        if t.get("ok") and cuda is None and "cuda" not in (t.get("unknown") or {}):
            return F.TORCH_CPU_BUILD.at(node.host, count=count, version=t.get("version"))
        if count < node.slots and spec.backend != "gloo":
            return F.GPUS_FEWER.at(node.host, count=count, slots=node.slots)
        if count > node.slots:
            return F.GPUS_UNUSED.at(node.host, count=count, slots=node.slots)
        if g.get("error"):
            return F.GPU_QUERY_FAILED.at(node.host, count=count, error=g["error"])
        return Finding.plain("gpus", node.host, OK,
                             f"{count} x {g['names'][0]}, driver {g['driver']}")
    return per_node(spec, probes, "gpus", one)


def check_interface(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """The interface exists, is up, has IPv4; nodes share a subnet; routes to peers use it."""
    nets: dict[str, ipaddress.IPv4Interface | ipaddress.IPv6Interface] = {}
    out: list[Finding] = []
    for node in spec.nodes:
        facts = probes[node.host].facts
        if facts is None:
            out.append(Finding.plain("interface", node.host, SKIP, "no facts"))
            continue
        if facts.get("interfaces_error"):
            out.append(F.INTERFACES_UNLISTED.at(node.host, error=facts["interfaces_error"]))
            continue
        names = [i["name"] for i in facts["interfaces"]]
        iface = interface_of(node, facts, spec.master.addr)
        entry = next((i for i in facts["interfaces"] if i["name"] == iface), None)
        if entry is None:
            if node.interface:
                out.append(F.INTERFACE_MISSING.at(
                    node.host, interface=node.interface, names=", ".join(names),
                    choices=", ".join(n for n in names if n != "lo")))
            else:
                out.append(F.NO_ROUTE_TO_MASTER.at(node.host, master=spec.master.addr))
            continue
        if not entry["up"]:
            out.append(F.INTERFACE_DOWN.at(node.host, interface=iface))
            continue
        if not entry["ipv4"]:
            out.append(F.INTERFACE_NO_IPV4.at(node.host, interface=iface))
            continue
        nets[node.host] = ipaddress.ip_interface(entry["ipv4"][0])
        wrong = [(peer, info["route_dev"]) for peer, info in facts["peers"].items()
                 if info.get("route_dev") not in (None, iface, "lo")]
        if wrong and not spec.local:
            out.append(F.ROUTES_ELSEWHERE.at(
                node.host, routes=", ".join(f"{p} via {d}" for p, d in wrong), interface=iface,
                other=wrong[0][1]))
            continue
        how = "set" if node.interface else "detected"
        out.append(Finding.plain("interface", node.host, OK, f"{iface} ({how}) {entry['ipv4'][0]}"))
    if len(nets) > 1:
        first_host, first = next(iter(nets.items()))
        apart = {host: addr for host, addr in nets.items() if addr.ip not in first.network}
        out = [f for f in out if not (f.host in apart and f.status == OK)]  # (one pass)
        out += [F.OTHER_SUBNET.at(host, address=addr, first=first_host, network=first.network)
                for host, addr in apart.items()]
    return out


def check_hostname(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """The hostname does not resolve to loopback; nodes resolve each other consistently."""
    iface_addr = {}
    for node in spec.nodes:
        facts = probes[node.host].facts
        if facts:
            iface_addr[node.host] = address_of(interface_of(node, facts, spec.master.addr), facts)

    def one(node: NodeSpec, facts: DoctorFacts) -> Finding:
        loop = [a for a in facts["hostname_addrs"] if a.startswith("127.")]
        if loop and not spec.local:
            return F.HOSTNAME_LOOPBACK.at(
                node.host, hostname=facts["hostname"], loopback=loop[0],
                address=iface_addr.get(node.host) or "its cluster address")
        bad = []
        master = facts.get("master")
        if not master or not master["addrs"]:
            return F.MASTER_UNRESOLVED.at(node.host, master=spec.master.addr)
        for peer, info in facts["peers"].items():
            want = iface_addr.get(peer)
            if info["addrs"] and want and want not in info["addrs"] and \
                    not any(a.startswith("127.") for a in info["addrs"]):
                bad.append(f"{peer} -> {info['addrs'][0]} (its interface has {want})")
        if bad:
            return F.PEERS_RESOLVE_APART.at(node.host, peers="; ".join(bad))
        return Finding.plain("hostname", node.host, OK, f"{facts['hostname']} -> "
                       f"{', '.join(facts['hostname_addrs']) or 'unresolved'}")
    return per_node(spec, probes, "hostname", one)


def check_master_port(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    master = spec.nodes[0]
    mfacts = probes[master.host].facts
    out = []
    listening = (mfacts or {}).get("listening", {})
    if mfacts is not None and listening.get("master") is None:
        return [F.MASTER_PORT_IN_USE.at(master.host, error=listening.get("master_error"))]
    for node in spec.nodes:
        p = probes[node.host]
        if not p.ok or mfacts is None:
            out.append(Finding.plain("master port", node.host, SKIP, "not probed"))
            continue
        res = next((c for c in p.connects if c["label"] == "master"), None)
        if res is None:
            out.append(Finding.plain("master port", node.host, SKIP, "not tested"))
        elif res["error"]:
            out.append(F.MASTER_PORT_UNREACHABLE.at(node.host, master=spec.master.addr,
                                                    port=res["port"], error=res["error"]))
        else:
            text = f"{spec.master.addr}:{res['port']} reachable ({res['ms']:.0f} ms)"
            rng = mfacts.get("ephemeral_range")
            if node.host == master.host and rng and rng[0] <= res["port"] <= rng[1] \
                    and not spec.local:  # the local cluster picks a free port itself
                out.append(F.MASTER_PORT_EPHEMERAL.at(
                    node.host, master=spec.master.addr, port=res["port"], ms=f"{res['ms']:.0f}",
                    low=rng[0], high=rng[1]))
            else:
                out.append(Finding.plain("master port", node.host, OK, text))
    return out


def check_ports(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """Ephemeral TCP ports reachable between nodes (NCCL/Gloo do not use the master port only)."""
    out = []
    for node in spec.nodes:
        p = probes[node.host]
        if not p.ok:
            out.append(Finding.plain("ports", node.host, SKIP, "not probed"))
            continue
        peers = [c for c in p.connects if c["label"].startswith("peer:")]
        failed = [c for c in peers if c["error"]]
        if failed:
            c = failed[0]
            out.append(F.PEER_PORT_UNREACHABLE.at(
                node.host, peer=c["label"][5:], host=c["host"], port=c["port"], error=c["error"],
                more=f" and {len(failed) - 1} more" if len(failed) > 1 else ""))
        elif peers:
            out.append(Finding.plain("ports", node.host, OK, f"{len(peers)} peer(s) reachable"))
        else:
            out.append(Finding.plain("ports", node.host, OK, "single node"))
    return out


def check_firewall(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    def one(node: NodeSpec, facts: DoctorFacts) -> Finding:
        fw = facts["firewall"]
        parts = []
        if "nft_rules" in fw:
            parts.append(f"nft {fw['nft_rules']} rule(s), {fw.get('nft_drop', 0)} drop/reject")
        if "iptables_rules" in fw:
            parts.append(f"iptables {fw['iptables_rules']} rule(s)")
        if fw.get("kind"):  # the firewall's model (node/facts/firewall.py, setup's too)
            parts.append(f"{fw['kind']} {'active' if fw.get('active') else 'inactive'}")
        return Finding.plain("firewall", node.host, OK,
                             "; ".join(parts) or "no firewall tool found")
    return per_node(spec, probes, "firewall", one)


def check_resources(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """/dev/shm (DataLoader workers and NCCL use it) and free disk in workdir: a warning for
    each that is short, else one line of both."""
    def one(node: NodeSpec, facts: DoctorFacts) -> list[Finding]:
        shm, disk = facts.get("shm"), facts.get("disk")
        notes, short = [], []
        if shm is not None and shm["total"] < GIB:
            short.append(F.SHM_SMALL.at(node.host, total=f"{shm['total'] / GIB:.2f}"))
        elif shm is not None:
            notes.append(f"shared memory (/dev/shm) {shm['total'] / GIB:.1f} GiB in all")
        if disk is not None and disk["free"] < 5 * GIB:
            short.append(F.WORKDIR_DISK_LOW.at(node.host, free=f"{disk['free'] / GIB:.1f}"))
        elif disk is not None:
            notes.append(f"{disk['free'] / GIB:.0f} GiB free on the workdir's disk")
        return short or [Finding.plain("resources", node.host, OK, ", ".join(notes))]
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
            out.append(Finding.plain("clock", node.host, SKIP, "not probed"))
        elif abs(off - mid) > 1.0:
            out.append(F.CLOCK_SKEW.at(node.host, offset=f"{off - mid:+.1f}"))
        else:
            out.append(Finding.plain("clock", node.host, OK, f"{off - mid:+.2f} s"))
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
