"""RDMA truth: what keeps NCCL off InfiniBand or RoCE, or makes it fail there.

Pure functions of every node's ``rdma`` facts (``node.facts.rdma.read_rdma``: the HCAs in
``/sys/class/infiniband``, their ports, GIDs and netdevs) and the cluster file's ``env:``. A node
without RDMA devices gets no finding. What is judged, each a failure seen in public reports:

* HCAs without an ACTIVE port: NCCL finds "No device" and quietly runs on sockets (nccl#958);
  one ACTIVE port is enough (an unplugged second port is fine), unless ``NCCL_IB_HCA`` names the
  one that is down;
* a RoCE port whose only RoCE v2 GIDs are link-local (``fe80::``): not routable, RDMA times out
  (nccl#769, uccl PR#803);
* ``NCCL_IB_GID_INDEX`` in ``env:`` that points at no routable GID on a node (nccl#426,
  nccl#718, multus-cni#1100: nodes whose tables differ);
* the routable GID at different indexes across nodes or HCAs (one value cannot fit: nccl#890);
* ACTIVE ports of different link layers (InfiniBand and Ethernet) in one job.

The values ``run`` sets (``node.facts.rdma.recommend``) are shown on every node's ok row.
"""

from __future__ import annotations

import json
from collections import Counter

from ptcluster.cluster.model import ClusterSpec, NodeSpec
from ptcluster.doctor import findings as F
from ptcluster.doctor.checks import OK, SKIP, Finding, per_node
from ptcluster.doctor.node_report import NodeReport
from ptcluster.node.doctor_facts import DoctorFacts
from ptcluster.node.facts.rdma import (
    ETHERNET,
    Device,
    active_ports,
    best_gid,
    link_local,
    recommend,
    shown,
)

NAME = "rdma"


def _named(value: str) -> list[tuple[str, int | None]]:
    """``NCCL_IB_HCA``'s HCAs (``=mlx5_0:1,mlx5_1``); [] for an exclusion list (``^…``)."""
    if value.startswith("^"):
        return []
    out = []
    for part in value.lstrip("=").split(","):
        name, _, port = part.strip().partition(":")
        if name:
            out.append((name, int(port) if port.isdigit() else None))
    return out


def _down_chosen(devices: list[Device], chosen: str) -> list[str]:
    """The HCA ports ``NCCL_IB_HCA`` names that are not ACTIVE (or not there)."""
    bad = []
    for name, port in _named(chosen):
        ports = [p for d in devices if d["name"] == name for p in d["ports"]
                 if port is None or p["port"] == port]
        if not any(p["state"] == "ACTIVE" for p in ports):
            states = ", ".join(f"port {p['port']} {p['state']}" for p in ports) or "not found"
            bad.append(f"{name} ({states})")
    return bad


def _wrong_index(devices: list[Device], index: str) -> list[str]:
    """The ACTIVE RoCE ports whose GID at ``NCCL_IB_GID_INDEX`` is missing or link-local."""
    bad = []
    for name, port in active_ports(devices):
        if port["link_layer"] != ETHERNET:
            continue
        gid = next((g for g in port["gids"] if str(g["index"]) == index.strip()), None)
        if gid is None or link_local(gid["gid"]):
            best = best_gid(port)
            bad.append(f"{name}:{port['port']} has " + ("no GID there" if gid is None else
                                                        f"the link-local {shown(gid['gid'])} there")
                       + (f" (its routable RoCE v2 GID is index {best['index']})" if best
                          else ""))
    return bad


def _summary(devices: list[Device]) -> str:
    parts = []
    for name, port in active_ports(devices):
        gid = best_gid(port) if port["link_layer"] == ETHERNET else None
        layer = "RoCE" if port["link_layer"] == ETHERNET else port["link_layer"]
        netdev = (gid["ndev"] if gid else None) or ",".join(next(
            d["netdevs"] for d in devices if d["name"] == name)) or "no netdev"
        parts.append(f"{name}:{port['port']} {layer} {port['rate'] or '?'} ({netdev}"
                     + (f", GID {gid['index']} {shown(gid['gid'])}" if gid else "") + ")")
    return "; ".join(parts)


def judge_node(spec: ClusterSpec, node: NodeSpec, facts: DoctorFacts) -> Finding | None:
    """One node's RDMA devices by themselves (and the cluster file's ``env:``)."""
    devices = facts.get("rdma")
    if not devices:  # no RDMA stack, or an older node program: nothing to judge
        return None
    env = dict(spec.env)
    active = active_ports(devices)
    if not active:
        ports = ", ".join(f"{d['name']}:{p['port']} {p['state']} ({p['phys_state']})"
                          for d in devices for p in d["ports"])
        return F.RDMA_NO_ACTIVE_PORT.at(node.host, ports=ports)
    down = _down_chosen(devices, env["NCCL_IB_HCA"]) if env.get("NCCL_IB_HCA") else []
    if down:
        return F.RDMA_HCA_NOT_ACTIVE.at(node.host, down=", ".join(down))
    no_gid = [f"{name}:{p['port']}" for name, p in active
              if p["link_layer"] == ETHERNET and best_gid(p) is None]
    if no_gid:
        return F.RDMA_LINK_LOCAL_GID.at(node.host, ports=", ".join(no_gid))
    pinned = env.get("NCCL_IB_GID_INDEX")
    wrong = _wrong_index(devices, pinned) if pinned else []
    if wrong:
        return F.RDMA_GID_INDEX_WRONG.at(node.host, index=pinned, wrong="; ".join(wrong))
    said = recommend(devices)
    if len(set(said["gid_indexes"].values())) > 1:
        shown = ", ".join(f"{k} {v}" for k, v in said["gid_indexes"].items())
        return F.RDMA_GID_INDEX_DIFFERS.at(node.host, indexes=shown)
    told = [f"{k}={json.dumps(v)}" for k, v in (("NCCL_IB_HCA", said["hca"]),
                                    ("NCCL_IB_GID_INDEX", said["gid_index"])) if v is not None]
    return Finding.plain("rdma", node.host, OK, f"{_summary(devices)}; run sets {', '.join(told)} "
                   "(unless env: does)")


def judge_across(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """What only the nodes together show: link layers, and GID indexes, that differ."""
    layers: dict[str, str] = {}
    indexes: dict[str, int] = {}
    for node in spec.nodes:
        facts = probes[node.host].facts or {}
        said = recommend(facts.get("rdma") or [])
        if said["link_layers"]:
            layers[node.host] = "+".join(said["link_layers"])
        if said["gid_index"] is not None:
            indexes[node.host] = said["gid_index"]
    out = []
    if len(set(layers.values())) > 1:
        common = Counter(layers.values()).most_common(1)[0][0]
        out += [F.RDMA_LINK_LAYERS_DIFFER.at(host, layer=layer, common=common)
                for host, layer in layers.items() if layer != common]
    if len(set(indexes.values())) > 1 and "NCCL_IB_GID_INDEX" not in dict(spec.env):
        common_index = Counter(indexes.values()).most_common(1)[0][0]
        out += [F.RDMA_GID_INDEX_ACROSS.at(host, index=index, common=common_index)
                for host, index in indexes.items() if index != common_index]
    return out


def check_rdma(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """RDMA devices (InfiniBand, RoCE): an ACTIVE port, a routable RoCE v2 GID, one GID index
    and one link layer across nodes; the NCCL_IB_HCA / NCCL_IB_GID_INDEX values run sets."""
    mine = per_node(spec, probes, NAME, lambda node, facts: judge_node(spec, node, facts))
    mine = [f for f in mine if f.status != SKIP]  # a node not probed: its ssh row says so
    across = judge_across(spec, probes)
    named = {f.host for f in across}
    return [f for f in mine if not (f.host in named and f.status == OK)] + across
