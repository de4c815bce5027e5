"""A folder of the head's onto every node, in parallel (``node.data_agent``): each node says
which files its copy lacks (by content), gets only those (``remote.blobs``: raw on its channel,
a temp name, sha256 checked, then renamed), then reports every file's sha256, compared here with
the head's. The library only yields events (``on_event``); ``cli/`` prints them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ptcluster.errors import Problem
from ptcluster.node import PUSH
from ptcluster.node.wire import Kind
from ptcluster.push.scan import Listing
from ptcluster.remote.blobs import Blob, Outgoing, stream
from ptcluster.remote.group import Group, Member

CHECKING, SENDING, VERIFYING = "checking", "sending", "verifying"
UP_TO_DATE, PUSHED, FAILED = "up to date", "pushed", "failed"
HAVE_TIMEOUT = 120.0
"""Seconds for a node to say what it lacks, plus a second per ``HASH_RATE`` bytes of the set
(a node without a manifest hashes its whole copy)."""
HASH_RATE = 50e6


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
    files_sent: int = 0
    bytes_sent: int = 0
    deleted: int = 0
    problem: Problem | None = None


@dataclass(frozen=True)
class PushResult:
    nodes: dict[str, NodePush]
    files: int
    size: int
    seconds: float

    @property
    def failed(self) -> dict[str, NodePush]:
        return {h: n for h, n in self.nodes.items() if n.problem is not None}

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def bytes_sent(self) -> int:
        return sum(n.bytes_sent for n in self.nodes.values())


def members_for(members: Sequence[Member], dest: str) -> list[Member]:
    """The same nodes with push's config: the folder to write on each."""
    return [Member(m.host, m.transport, m.python, {"dest": dest}) for m in members]


def push(members: Sequence[Member], listing: Listing, *, delete: bool = False,
         on_event: Event | None = None) -> PushResult:
    """``listing``'s files onto every member (its ``config``: ``{"dest": ...}``): every node's
    outcome, a failed one named with its problem, the others' work done."""
    say = on_event or (lambda progress: None)
    begun = time.monotonic()
    timeout = HAVE_TIMEOUT + listing.size / HASH_RATE
    group = Group(members, PUSH, answer=Kind.STORED, kinds=(Kind.HAVE,))
    out: dict[str, NodePush] = {}
    finished = False
    try:
        files = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in listing.files]
        for host in group.channels:
            group.send(host, Kind.HAVE, {"files": files})
        group.wait(Kind.HAVE, timeout)
        sending = _plan(group, listing, out, say)
        stream(group, sending, tick=lambda h, s: say(_sending(h, s)),
               finished=lambda h, s: say(Progress(h, VERIFYING, f"{s.count} file(s) "
                                                  f"({s.sent / 1e6:.1f} MB) sent; verifying",
                                                  s.sent, s.total)))
        asked = [h for h in sending if group.alive(h)]
        for host in asked:
            group.send(host, Kind.STORED, {"delete": delete})
        group.wait(Kind.STORED, timeout, hosts=asked)
        for host in asked:
            answer = group.result.nodes[host].answers.get(Kind.STORED)
            if answer is not None:
                out[host] = _verdict(host, listing, answer, sending[host])
                say(Progress(host, out[host].state, _line(out[host]), final=True))
        finished = True
    finally:
        result = group.close(bye=Kind.BYE if finished else None)
    for host, r in result.nodes.items():
        if host not in out:
            problem = (r.problem or Problem(None, "no answer", None)).by(host)
            state = sending.get(host)
            out[host] = NodePush(host, FAILED, bytes_sent=state.sent if state else 0,
                                 problem=problem)
            say(Progress(host, FAILED, f"failed: {problem.what}", final=True))
    return PushResult({m.host: out[m.host] for m in members}, len(listing.files), listing.size,
                      time.monotonic() - begun)


def _plan(group: Group, listing: Listing, out: dict[str, NodePush],
          say: Event) -> dict[str, Outgoing]:
    """From every node's ``have``: those refused (in ``out``) and what to send the others."""
    sending = {}
    for host, r in group.result.nodes.items():
        have = r.answers.get(Kind.HAVE)
        if have is None:
            continue
        if not have.get("ok"):
            problem = Problem(host, str(have.get("problem")), str(have.get("fix") or "") or None)
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


def _verdict(host: str, listing: Listing, answer: dict[str, Any], sent: Outgoing) -> NodePush:
    """The node's digests against the head's: a failed file, then a differing one, named."""
    failed: dict[str, dict[str, Any]] = answer.get("failed") or {}
    if failed:
        path, why = next(iter(sorted(failed.items())))
        more = f" (and {len(failed) - 1} more file(s))" if len(failed) > 1 else ""
        return NodePush(host, FAILED, sent.count, sent.sent, problem=Problem(
            host, f"{path}: {why.get('problem')}{more}", str(why.get("fix") or "") or None))
    theirs: dict[str, Any] = answer.get("files") or {}
    wrong = [f.path for f in listing.files if theirs.get(f.path) != f.sha256]
    if wrong:
        return NodePush(host, FAILED, sent.count, sent.sent, problem=Problem(
            host, f"{len(wrong)} file(s) differ from the head's after the push: "
            f"{', '.join(wrong[:3])}", "push again; if it persists, check that node's disk"))
    state = PUSHED if sent.count else UP_TO_DATE
    return NodePush(host, state, sent.count, sent.sent, int(answer.get("deleted") or 0))


def _line(node: NodePush) -> str:
    if node.problem is not None:
        return f"failed: {node.problem.what}"
    deleted = f"; {node.deleted} file(s) deleted" if node.deleted else ""
    if node.state == UP_TO_DATE:
        return f"up to date, every file's sha256 the head's{deleted}"
    return (f"{node.files_sent} file(s) ({node.bytes_sent / 1e6:.1f} MB) sent, every file's "
            f"sha256 the head's{deleted}")
