"""The relay's chain, set up from the head (``node.data_relay``): each node but the first
listens on its cluster address for the one before it, each but the last connects to the one
after it, all with one random secret per chain told over the head's own channels. The head then
sends each file once, to the first node; the nodes pass it on. The same for ``ptcluster push``'s
files (``push.send``) and the project's environment's wheels (``venvs.ship``): ``relayed``
sets the chain up and says what the head sends whom."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Sequence
from itertools import pairwise

from ptcluster.node.wire import Kind
from ptcluster.remote.blobs import Blob, Outgoing
from ptcluster.remote.group import Group, Member

RELAY_MIN = 3
"""Nodes from which a push or a ship relays by default (below it the head sends each node its
files).
The chain's start-up is two round trips (~0.02 s on the testbed); each node the head sends to
itself costs it one more ssh stream to encrypt: 256 MiB to 3 testbed nodes took 4.15 s
direct, 2.31 s relayed (one rsync: 1.25 s)."""
LINK_TIMEOUT = 30.0


def address(host: str) -> str | None:
    """The address the nodes reach ``host`` at, as the head resolves it (None: unresolved)."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, UnicodeError):
        return None


def link(group: Group, members: Sequence[Member], hosts: list[str]) -> list[str]:
    """The chain over ``hosts`` (in this order): its hosts when every link is up, else ``[]``
    (then the head sends every node its files itself). Each node's address: as the head
    resolves its host, else where ssh reached it (its ``have``)."""
    addrs = {m.host: str(m.config.get("addr") or group.result.nodes[m.host].answers.get(
        Kind.HAVE, {}).get("addr") or "") for m in members}
    if len(hosts) < 2 or not all(addrs[h] for h in hosts):
        return []
    secret = secrets.token_hex(32)
    for before, host in pairwise(hosts):
        group.send(host, Kind.RELAY, {"bind": addrs[host], "secret": secret,
                                      "peer": addrs[before]})
    group.wait(Kind.RELAY, LINK_TIMEOUT, hosts=hosts[1:])
    ports = {h: group.result.nodes[h].answers.get(Kind.RELAY, {}).get("port")
             for h in hosts[1:]}
    if not all(ports.values()):
        return []
    for host, after in pairwise(hosts):
        group.send(host, Kind.LINK, {"addr": addrs[after], "port": ports[after],
                                     "secret": secret})
    group.wait(Kind.LINK, LINK_TIMEOUT, hosts=hosts[:-1])
    if not all(group.result.nodes[h].answers.get(Kind.LINK, {}).get("ok") for h in hosts[:-1]):
        return []
    return hosts


def relayed(group: Group, members: Sequence[Member], sending: dict[str, Outgoing],
            relay: bool | None = None) -> tuple[list[str], dict[str, Outgoing]]:
    """The chain over the nodes in ``sending`` whose channel is up (``relay``, default: from
    ``RELAY_MIN`` members), and what the head sends each then (``union``); ``([], sending)``
    where there is none (the head sends every node its files itself)."""
    if not (len(members) >= RELAY_MIN if relay is None else relay):
        return [], sending
    chain = link(group, members, [h for h in sending if group.alive(h)])
    return (chain, union(chain, sending)) if chain else ([], sending)


def union(chain: list[str], sending: dict[str, Outgoing]) -> dict[str, Outgoing]:
    """The chain's first node gets every file any node of it lacks, once each (a file is its
    path where it has one, push's, else its digest, a wheel's; in that order); the others get
    theirs from it."""
    every = {_key(b): b for h in chain for b in sending[h].blobs}
    out = {h: Outgoing.of([]) for h in sending}
    out[chain[0]] = Outgoing.of([every[k] for k in sorted(every)])
    return out


def _key(blob: Blob) -> str:
    return str(blob.frame.get("path") or blob.frame["sha256"])
