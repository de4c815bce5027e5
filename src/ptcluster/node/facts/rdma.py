"""The node's RDMA devices as the kernel shows them, and the NCCL settings they call for.

Standard library only; a part of doctor's facts program and of the guard (``node/__init__.py``).
Read from sysfs (the kernel's ``Documentation/ABI/stable/sysfs-class-infiniband``)::

    /sys/class/infiniband/<hca>/ports/<n>/state           "4: ACTIVE"
    /sys/class/infiniband/<hca>/ports/<n>/phys_state      "5: LinkUp"
    /sys/class/infiniband/<hca>/ports/<n>/rate            "100 Gb/sec (4X EDR)"
    /sys/class/infiniband/<hca>/ports/<n>/link_layer      "InfiniBand" | "Ethernet"
    /sys/class/infiniband/<hca>/ports/<n>/gids/<i>        "0000:...:ffff:0a00:0001"
    /sys/class/infiniband/<hca>/ports/<n>/gid_attrs/types/<i>   "IB/RoCE v1" | "RoCE v2"
    /sys/class/infiniband/<hca>/ports/<n>/gid_attrs/ndevs/<i>   "eth2"
    /sys/class/infiniband/<hca>/device/net/<netdev>/

``sysfs`` is a parameter, so tests read recorded trees (``tests/unit/data/rdma``). The choice of
GID follows NCCL's own (``net_ib``: a GID that is all zeros, or ``fe80::`` with nothing after it,
is not configured; a link-local one is not routable; NCCL's default is RoCE v2 over IPv4,
``NCCL_IB_ROCE_VERSION_NUM=2``, ``NCCL_IB_ADDR_FAMILY=AF_INET``), so what doctor recommends is
what NCCL would find to work.
"""

from __future__ import annotations

import ipaddress
import os
from typing import TypedDict

SYSFS = "/sys/class/infiniband"
ACTIVE = "ACTIVE"
ETHERNET, INFINIBAND = "Ethernet", "InfiniBand"
ROCE_V2 = "RoCE v2"
MAX_GIDS = 256
"""GID table entries read per port at most (mlx5's table has 256; most are unset)."""


def _sys_read(path: str) -> str | None:
    """A sysfs attribute's text; None when it is absent or unreadable (an unset GID's type
    reads as EINVAL)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(512).strip()
    except OSError:
        return None


class Gid(TypedDict):
    """A port's configured GID."""

    index: int
    gid: str
    type: str | None
    """``IB/RoCE v1`` or ``RoCE v2``."""
    ndev: str | None
    """The network device it is bound to (RoCE)."""


class Port(TypedDict):
    port: int
    state: str | None
    """``ACTIVE``, ``DOWN``, ..."""
    phys_state: str | None
    rate: str | None
    link_layer: str | None
    """``InfiniBand`` or ``Ethernet`` (RoCE)."""
    gids: list[Gid]


class Device(TypedDict):
    """An RDMA device (HCA) as :func:`read_rdma` reads it: doctor's ``rdma`` (``DoctorFacts``),
    the guard's NCCL defaults and its fallback cause."""

    name: str
    netdevs: list[str]
    ports: list[Port]


class Advice(TypedDict):
    """What NCCL should be told on a node (:func:`recommend`)."""

    hca: str | None
    gid_index: int | None
    link_layers: list[str]
    gid_indexes: dict[str, int | None]
    """Per ACTIVE RoCE port (``HCA:PORT``), the GID index NCCL's defaults pick there."""


def _port_state(text: str | None) -> str | None:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``."""
    return None if text is None else text.split(":", 1)[-1].strip()


def _sys_ls(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _port_gids(port_dir: str) -> list[Gid]:
    """The port's configured GIDs (an unset entry is left out), each with its type and netdev."""
    out: list[Gid] = []
    names = [n for n in _sys_ls(os.path.join(port_dir, "gids")) if n.isdigit()]
    for name in sorted(names, key=int)[:MAX_GIDS]:
        gid = _sys_read(os.path.join(port_dir, "gids", name))
        if gid is None or not configured(gid):
            continue
        out.append({"index": int(name), "gid": gid,
                    "type": _sys_read(os.path.join(port_dir, "gid_attrs", "types", name)),
                    "ndev": _sys_read(os.path.join(port_dir, "gid_attrs", "ndevs", name))})
    return out


def read_rdma(sysfs: str = SYSFS) -> list[Device]:
    """Every RDMA device under ``sysfs`` with its ports; [] when there is none (no
    ``/sys/class/infiniband``: the node has no RDMA stack, which is fine)."""
    devices: list[Device] = []
    for hca in _sys_ls(sysfs):
        base = os.path.join(sysfs, hca)
        ports: list[Port] = []
        numbers = sorted((p for p in _sys_ls(os.path.join(base, "ports")) if p.isdigit()), key=int)
        for port in numbers:
            pdir = os.path.join(base, "ports", port)

            def attr(name: str, pdir: str = pdir) -> str | None:
                return _sys_read(os.path.join(pdir, name))

            ports.append({"port": int(port), "state": _port_state(attr("state")),
                          "phys_state": _port_state(attr("phys_state")),
                          "rate": attr("rate"), "link_layer": attr("link_layer"),
                          "gids": _port_gids(pdir)})
        devices.append({"name": hca, "netdevs": _sys_ls(os.path.join(base, "device", "net")),
                        "ports": ports})
    return devices


def _gid_address(gid: str) -> ipaddress.IPv6Address | None:
    try:
        return ipaddress.IPv6Address(gid)
    except ValueError:
        return None


def configured(gid: str) -> bool:
    """False for an unset entry: all zeros, or ``fe80::`` with nothing after (NCCL's test)."""
    addr = _gid_address(gid)
    if addr is None:
        return False
    head, trailer = addr.packed[:4], addr.packed[4:]
    return any(trailer) or head not in (b"\0\0\0\0", b"\xfe\x80\0\0")


def link_local(gid: str) -> bool:
    """A ``fe80::/64`` GID: made from the MAC address, never routed (NCCL skips it)."""
    addr = _gid_address(gid)
    return addr is not None and addr.packed[:8] == b"\xfe\x80" + b"\0" * 6


def ipv4_of(gid: str) -> str | None:
    """The IPv4 address of an IPv4-mapped GID (``::ffff:a.b.c.d``), else None."""
    addr = _gid_address(gid)
    mapped = addr.ipv4_mapped if addr is not None else None
    return None if mapped is None else str(mapped)


def shown(gid: str) -> str:
    """A GID as people write it: ``::ffff:10.0.0.1``, ``fe80::ac0:ebff:feda:1cfb``."""
    addr = _gid_address(gid)
    if addr is None:
        return gid
    v4 = addr.ipv4_mapped
    return f"::ffff:{v4}" if v4 is not None else addr.compressed


def best_gid(port: Port) -> Gid | None:
    """The GID NCCL's defaults pick on a RoCE port: the first RoCE v2 one over IPv4, else the
    first RoCE v2 global IPv6 one; None when only link-local (or no RoCE v2) GIDs are there."""
    v2 = [g for g in port["gids"] if g.get("type") == ROCE_V2 and not link_local(g["gid"])]
    v4 = [g for g in v2 if ipv4_of(g["gid"])]
    return (v4 or v2)[0] if v4 or v2 else None


def active_ports(devices: list[Device]) -> list[tuple[str, Port]]:
    return [(d["name"], p) for d in devices for p in d["ports"] if p["state"] == ACTIVE]


def recommend(devices: list[Device]) -> Advice:
    """What NCCL should be told on this node: ``NCCL_IB_HCA`` (its ACTIVE ports, ``=`` for exact
    names: ``mlx5_1`` alone would also match ``mlx5_10``) and, on RoCE, ``NCCL_IB_GID_INDEX``
    (one value for every HCA of the node: NCCL takes one, nccl#890); each None when there is
    nothing to say. ``link_layers``: of the ACTIVE ports."""
    active = active_ports(devices)
    layers = sorted({str(p["link_layer"]) for _, p in active})
    hca = "=" + ",".join(f"{name}:{p['port']}" for name, p in active) if active else None
    indexes = {name + f":{p['port']}": gid["index"] if (gid := best_gid(p)) else None
               for name, p in active if p["link_layer"] == ETHERNET}
    found = set(indexes.values())
    gid_index = next(iter(found)) if len(found) == 1 else None
    return {"hca": hca, "gid_index": gid_index, "link_layers": layers,
            "gid_indexes": indexes}


def rdma_env(devices: list[Device]) -> dict[str, str]:
    """The variables :func:`recommend` gives values for (the guard sets each one the user's
    ``env:`` and the node's own environment leave unset)."""
    said = recommend(devices)
    env = {}
    if said["hca"]:
        env["NCCL_IB_HCA"] = str(said["hca"])
    if said["gid_index"] is not None:
        env["NCCL_IB_GID_INDEX"] = str(said["gid_index"])
    return env


def fallback_cause(devices: list[Device], env: dict[str, str]) -> str:
    """Why NCCL most likely used TCP sockets on a node with RDMA devices (the ranks'
    environment ``env``): what doctor's rdma check would say, in one phrase."""
    if env.get("NCCL_IB_DISABLE", "0").strip() not in ("", "0"):
        return "NCCL_IB_DISABLE is set"
    if env.get("NCCL_NET", "").lower() == "socket":
        return "NCCL_NET=Socket is set"
    if not active_ports(devices):
        return "no HCA port is ACTIVE (" + ", ".join(
            f"{d['name']}:{p['port']} {p['state']}" for d in devices for p in d["ports"]) + ")"
    bare = [f"{name}:{p['port']}" for name, p in active_ports(devices)
            if p["link_layer"] == ETHERNET and best_gid(p) is None]
    if bare:
        return f"only link-local RoCE v2 GIDs on {', '.join(bare)}"
    return ("NCCL could not open the HCAs (in a container: /dev/infiniband and the RDMA "
            "libraries, libibverbs, must be there)")
