"""Which network interface a node's NCCL/Gloo sockets should use (the one rule, shared), and
where a rendezvous port of ``master.port: auto`` is looked for.

Standard library only, and shipped with the programs that run on nodes (the guard decides the
interface at launch with it, the doctor's probe reports what it decides), so ``doctor`` can never
approve an interface that ``run`` would not pick.

The rule: the interface of this node's route to the master's address; on the master itself
(the kernel routes its own address over ``lo``) the interface that holds that address.
"""

import json
import socket
import subprocess
from typing import TypedDict

AUTO_PORTS = range(29500, 30000)
"""Where ``master.port: auto`` looks for a free port (the guard at launch, the doctor's probe):
torch's usual range, below the kernel's ephemeral ports (32768 up), so that no outgoing
connection takes the port between the check and the store's bind."""


def route_interface(addr: str) -> tuple[str, str]:
    """``(interface, "")`` for reaching ``addr`` from here, or ``("", why it is unknown)``."""
    try:
        ip = str(socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0])
    except (OSError, UnicodeError) as exc:
        return "", f"cannot resolve {addr}: {exc}"
    dev, why = route_dev(ip)
    if dev == "lo" and not ip.startswith("127."):
        holder = interface_holding(ip)
        if holder:
            return holder, ""
    return dev, why


def route_dev(ip: str) -> tuple[str, str]:
    """``(interface, "")`` of the kernel's route to the address ``ip`` as it says it (``lo`` for
    one of this node's own), or ``("", why there is none)``."""
    try:
        out = subprocess.run(["ip", "-o", "route", "get", ip], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.SubprocessError) as exc:
        return "", f"`ip route get {ip}` failed: {exc}"
    words = out.stdout.split()
    if out.returncode != 0 or "dev" not in words:
        return "", f"no route to {ip}: {(out.stderr or out.stdout).strip()}"
    return words[words.index("dev") + 1], ""


def interface_holding(ip: str) -> str:
    """The interface that has ``ip`` as one of its IPv4 addresses ('' when none)."""
    for dev, address in _ipv4_addresses():
        if address == ip:
            return dev
    return ""


def address_on(dev: str) -> str:
    """The first IPv4 address of interface ``dev`` ('' when none): this node's address on the
    network its ranks talk over (what peers reach it at)."""
    return next((address for d, address in _ipv4_addresses() if d == dev), "")


def _ipv4_addresses() -> list[tuple[str, str]]:
    """(interface, address) for every IPv4 address here, in ``ip``'s order. The guard needs
    them where the doctor's listing (``ip -j``, iproute2 >= 4.13) is not there: then from
    ``ip -o -4 addr show``, which every iproute2 has."""
    links, why = interfaces()
    if why is None:
        return [(link["name"], cidr.split("/")[0]) for link in links for cidr in link["ipv4"]]
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_ip_oneline(out)


def parse_ip_oneline(text: str) -> list[tuple[str, str]]:
    """``ip -o -4 addr show`` -> [(interface, address)] (``2: eth0    inet 10.0.0.1/24 ...``)."""
    return [(f[1].split("@")[0], f[3].split("/")[0]) for f in map(str.split, text.splitlines())
            if len(f) > 3]


class Interface(TypedDict):
    """One of the node's network interfaces (:func:`interfaces`): doctor's ``interfaces``."""

    name: str
    up: bool
    ipv4: list[str]
    """``addr/len`` each."""


def interfaces() -> tuple[list[Interface], str | None]:
    """(this node's interfaces: ``[{name, up, ipv4: ["addr/len"]}]``, None), or ([], why they
    could not be listed): the one listing of the node's addresses (``ip -j addr show``)."""
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.SubprocessError) as exc:
        return [], f"`ip -j addr show` failed: {exc}"
    if out.returncode != 0:
        why = (out.stdout + out.stderr).strip() or f"exit status {out.returncode}"
        return [], f"`ip -j addr show` failed: {why}"
    try:
        return parse_ip_addr(out.stdout), None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return [], f"`ip -j addr show` output does not parse ({type(exc).__name__}: {exc})"


def parse_ip_addr(text: str) -> list[Interface]:
    """``ip -j addr show`` -> [{name, up, ipv4: ["addr/len"]}]; raises on unexpected output."""
    links = json.loads(text)
    if not isinstance(links, list):
        raise ValueError(f"expected a JSON list, got {type(links).__name__}")
    return [{
        "name": str(link["ifname"]),
        "up": "UP" in link.get("flags", []) and link.get("operstate") != "DOWN",
        "ipv4": [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])
                 if a.get("family") == "inet"],
    } for link in links]
