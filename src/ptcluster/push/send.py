"""A folder of the head's onto every node, in parallel (``node.data_agent``): each node says
which files its copy lacks (by content), gets only those (``remote.blobs``: raw on its channel,
a temp name, sha256 checked, then renamed), then reports every file's sha256, compared here with
the head's. The library only yields events (``on_event``); ``cli/`` prints them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ptcluster.errors import Problem
from ptcluster.node import PUSH
from ptcluster.node.wire import HEARTBEAT_EVERY, HEARTBEAT_TIMEOUT, Kind
from ptcluster.push.scan import Listing
from ptcluster.remote.blobs import Blob, Outgoing, stream
from ptcluster.remote.group import Group, Member
from ptcluster.remote.relay import address, relayed

if TYPE_CHECKING:  # (the node program's own imports are not the head's: ~6 ms of every run)
    from ptcluster.node.data_agent import PushConfig

CHECKING, SENDING, VERIFYING = "checking", "sending", "verifying"
UP_TO_DATE, PUSHED, FAILED = "up to date", "pushed", "failed"
HAVE_TIMEOUT = 120.0
"""Seconds for a node to say what it lacks, plus a second per ``HASH_RATE`` bytes of the set
(a node without a manifest hashes its whole copy)."""
HASH_RATE = 50e6
STORED_TIMEOUT = 600.0
"""Seconds for a node to have its files all in and hashed once the head sent its last byte."""


@dataclass(frozen=True)
class Progress:
    """One node's step as it happens (``sent`` of ``total`` bytes); ``final``: its outcome."""

    host: str
    state: str
    text: str
    sent: int = 0
    total: int = 0
    final: bool = False


Event = Callable[[Progress], None]


@dataclass(frozen=True)
class NodePush:
    host: str
    state: str
    files: int = 0
    """The files it lacked (sent by the head, or by the node before it in the relay)."""
    size: int = 0
    files_sent: int = 0
    """By the head itself."""
    bytes_sent: int = 0
    deleted: int = 0
    problem: Problem | None = None

    def to_json(self) -> dict[str, Any]:
        """``push --json``'s node: its outcome and figures, and a failure's problem (what,
        fix, and its code and fields: ``push.*``, ``file.*``, ``node.*``)."""
        said = self.problem
        return {"host": self.host, "state": self.state, "files": self.files,
                "size": self.size, "files_sent": self.files_sent,
                "bytes_sent": self.bytes_sent, "deleted": self.deleted,
                "problem": None if said is None else {
                    "what": said.what, "fix": said.fix, "code": said.code,
                    "fields": said.fields}}


@dataclass(frozen=True)
class PushResult:
    nodes: dict[str, NodePush]
    files: int
    size: int
    seconds: float
    chain: list[str]
    """The relay's nodes in order (empty: the head sent each node its files)."""

    @property
    def failed(self) -> dict[str, NodePush]:
        return {h: n for h, n in self.nodes.items() if n.problem is not None}

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def bytes_sent(self) -> int:
        """The head's egress: every byte it sent, to every node."""
        return sum(n.bytes_sent for n in self.nodes.values())

    def to_json(self) -> dict[str, Any]:
        """``push --json``: the whole push, every node's outcome."""
        return {"ok": self.ok, "files": self.files, "size": self.size,
                "bytes_sent": self.bytes_sent, "seconds": round(self.seconds, 3),
                "chain": self.chain, "nodes": [n.to_json() for n in self.nodes.values()]}


def members_for(members: Sequence[Member], dest: str) -> list[Member[PushConfig]]:
    """The same nodes with push's config: the folder to write on each, and the address the
    other nodes reach it at (the relay's)."""
    return [Member(m.host, m.transport, m.python, {"dest": dest, "addr": address(m.host)})
            for m in members]


def push(members: Sequence[Member[PushConfig]], listing: Listing, *, delete: bool = False,
         relay: bool | None = None, on_event: Event | None = None) -> PushResult:
    """``listing``'s files onto every member (its ``config``: ``{"dest", "addr"}``): every
    node's outcome, a failed one named with its problem, the others' work done. ``relay``
    (default: from ``remote.relay.RELAY_MIN`` nodes): the nodes pass the files on to each
    other, the head sends each once; a node the chain failed gets what it lacks from the head
    afterwards."""
    say = on_event or (lambda progress: None)
    begun = time.monotonic()
    # heartbeats: a node whose link is cut mid-push sees no EOF; its program ends itself after
    # HEARTBEAT_TIMEOUT s of silence (``node.data_agent``)
    members = [replace(m, config=_config(m)) for m in members]
    group = Group(members, PUSH, answer=Kind.STORED, kinds=(Kind.HAVE, Kind.RELAY, Kind.LINK),
                  heartbeat=HEARTBEAT_EVERY)
    out: dict[str, NodePush] = {}
    sent: dict[str, list[int]] = {}
    finished = False
    try:
        sending = _have(group, listing, out, say, list(group.channels))
        wanted = {h: (len(s.blobs), s.total) for h, s in sending.items()}
        chain, sending = relayed(group, members, sending, relay)
        _send(group, sending, say)
        for host, state in sending.items():
            sent[host] = [state.count, state.sent]
        answers = _stored(group, list(sending), delete)
        again = []
        for host, answer in answers.items():
            node = _verdict(host, listing, answer, *wanted[host], *sent[host])
            if node.problem is not None and chain and group.alive(host):
                again.append(host)  # (the chain failed it: the head sends it the rest)
            else:
                out[host] = node
                say(Progress(host, node.state, _line(node), final=True))
        if again:
            _repair(group, listing, again, delete, out, sent, wanted, say)
        finished = True
    finally:
        result = group.close(bye=Kind.BYE if finished else None)
    for host, r in result.nodes.items():
        if host not in out:
            problem = (r.problem or Problem(None, "no answer", None)).by(host)
            out[host] = NodePush(host, FAILED, bytes_sent=sent.get(host, [0, 0])[1],
                                 problem=problem)
            say(Progress(host, FAILED, f"failed: {problem.what}", final=True))
    return PushResult({m.host: out[m.host] for m in members}, len(listing.files), listing.size,
                      time.monotonic() - begun, chain)


def _config(member: Member[PushConfig]) -> PushConfig:
    """The member's config with the heartbeats' ``silence`` beneath it."""
    return {"silence": HEARTBEAT_TIMEOUT, **member.config}


def _have(group: Group, listing: Listing, out: dict[str, NodePush], say: Event,
          hosts: list[str]) -> dict[str, Outgoing]:
    """Ask ``hosts`` which files they lack: what to send each (the refused in ``out``)."""
    files = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in listing.files]
    for host in hosts:
        group.result.nodes[host].answers.pop(Kind.HAVE, None)
        group.send(host, Kind.HAVE, {"files": files})
    group.wait(Kind.HAVE, HAVE_TIMEOUT + listing.size / HASH_RATE, hosts=hosts)
    return _plan(group, listing, out, say, hosts)


def _send(group: Group, sending: dict[str, Outgoing], say: Event) -> None:
    stream(group, sending, tick=lambda h, s: say(_sending(h, s)),
           finished=lambda h, s: say(Progress(h, VERIFYING, f"{s.count} file(s) "
                                              f"({s.sent / 1e6:.1f} MB) sent; verifying",
                                              s.sent, s.total)))


def _stored(group: Group, hosts: list[str], delete: bool) -> dict[str, dict[str, Any]]:
    """Every node's digests as stored now (those whose channel is up)."""
    asked = [h for h in hosts if group.alive(h)]
    for host in asked:
        group.result.nodes[host].answers.pop(Kind.STORED, None)
        group.send(host, Kind.STORED, {"delete": delete})
    group.wait(Kind.STORED, STORED_TIMEOUT, hosts=asked)
    return {h: a for h in asked
            if (a := group.result.nodes[h].answers.get(Kind.STORED)) is not None}


def _repair(group: Group, listing: Listing, hosts: list[str], delete: bool,
            out: dict[str, NodePush], sent: dict[str, list[int]],
            wanted: dict[str, tuple[int, int]], say: Event) -> None:
    """The nodes the chain failed: what they still lack, from the head."""
    sending = _have(group, listing, out, say, hosts)
    _send(group, sending, say)
    for host, answer in _stored(group, list(sending), delete).items():
        sent[host][0] += sending[host].count
        sent[host][1] += sending[host].sent
        out[host] = _verdict(host, listing, answer, *wanted[host], *sent[host])
        say(Progress(host, out[host].state, _line(out[host]), final=True))


def _plan(group: Group, listing: Listing, out: dict[str, NodePush], say: Event,
          hosts: list[str]) -> dict[str, Outgoing]:
    """From every node's ``have``: those refused (in ``out``) and what to send the others."""
    sending = {}
    for host in hosts:
        have = group.result.nodes[host].answers.get(Kind.HAVE)
        if have is None:
            continue
        if not have.get("ok"):
            problem = Problem.received(host, have)
            out[host] = NodePush(host, FAILED, problem=problem)
            say(Progress(host, FAILED, f"failed: {problem.what}", final=True))
            continue
        missing = set(have["missing"])
        sending[host] = state = Outgoing.of([
            Blob(listing.src / f.path, f.size, {"sha256": f.sha256, "size": f.size,
                                                "path": f.path, "mtime": f.mtime_ns})
            for f in listing.files if f.path in missing])
        say(Progress(host, SENDING, f"{len(missing)} of {len(listing.files)} file(s) to send "
                     f"({state.total / 1e6:.1f} MB)", 0, state.total))
    return sending


def _sending(host: str, s: Outgoing) -> Progress:
    return Progress(host, SENDING, f"{s.sent / 1e6:.1f} of {s.total / 1e6:.1f} MB sent",
                    s.sent, s.total)


def _verdict(host: str, listing: Listing, answer: dict[str, Any], files: int, size: int,
             count: int, sent: int) -> NodePush:
    """The node's digests against the head's: a failed file, then a differing one, named.
    ``files`` and ``size``: what it lacked; ``count`` and ``sent``: what the head sent it."""
    failed: dict[str, dict[str, Any]] = answer.get("failed") or {}
    if failed:
        path, why = next(iter(sorted(failed.items())))
        more = f" (and {len(failed) - 1} more file(s))" if len(failed) > 1 else ""
        first = Problem.received(host, why)  # (the node's file.* or push.disk-full)
        return NodePush(host, FAILED, files, size, count, sent,
                        problem=replace(first, what=f"{path}: {first.what}{more}"))
    theirs: dict[str, Any] = answer.get("files") or {}
    wrong = [f.path for f in listing.files if theirs.get(f.path) != f.sha256]
    if wrong:
        return NodePush(host, FAILED, files, size, count, sent, problem=Problem(
            host, f"{len(wrong)} file(s) differ from the head's after the push: "
            f"{', '.join(wrong[:3])}", "push again; if it persists, check that node's disk"))
    return NodePush(host, PUSHED if files else UP_TO_DATE, files, size, count, sent,
                    int(answer.get("deleted") or 0))


def _line(node: NodePush) -> str:
    if node.problem is not None:
        return f"failed: {node.problem.what}"
    deleted = f"; {node.deleted} file(s) deleted" if node.deleted else ""
    if node.state == UP_TO_DATE:
        return f"up to date, every file's sha256 the head's{deleted}"
    relayed = "" if node.files_sent == node.files else \
        f" ({node.files - node.files_sent} passed on by another node)"
    return (f"{node.files} file(s) ({node.size / 1e6:.1f} MB) received{relayed}, every "
            f"file's sha256 the head's{deleted}")
