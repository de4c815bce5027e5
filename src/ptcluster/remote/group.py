"""Ask every node once: one node program per node, and a result per node (fabric's idea of a
``GroupResult``: which nodes answered, which failed and why, never stopping at the first).

doctor's facts, ``kill`` through the guards and ``ps`` each ask every node of a cluster one
thing. They share this plumbing: the channels started in ``start_all``'s window, the frames
handed from the hub's thread to the caller's through one queue, a node that could not be
started, that ended without answering, that sent a bad frame or that said nothing by the
deadline (killed then), and every channel closed against one deadline. Each caller words the
outcome its own way from :class:`NodeResult` (``why``, ``problem``, ``fix``).
"""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any, Generic, TypeVar

from ptcluster.errors import Problem
from ptcluster.node import Program
from ptcluster.node.wire import control, split
from ptcluster.remote.channel import NodeChannel, close_all, start_all
from ptcluster.remote.transport import Transport, explain_channel_failure

CLOSE_TIMEOUT = 5.0
"""Seconds every channel has to end after its EOF (one deadline for all, not one each)."""
LATE_FIX = "check the node is up and not overloaded"
Config = TypeVar("Config", bound=Mapping[str, object])


@dataclass(frozen=True)
class Member(Generic[Config]):
    """One node to ask: how to reach it, its interpreter, its program's config line."""

    host: str
    transport: Transport
    python: str
    config: Config
    """Its config line (a program's declared config: ``node.probe.ProbeConfig``, ...; a
    ``Member[VenvsConfig]`` holds that program's, so mypy checks the keys where it is built
    and where it is read)."""


class Why(str, Enum):
    """Why a node has no answer."""

    NOT_STARTED = "not started"
    """Its channel could not be started (``problem``/``fix`` from the transport)."""
    CLOSED = "closed"
    """Its channel ended without the answer (``problem``/``fix`` from its exit status and
    stderr: ``explain_channel_failure``)."""
    BAD_FRAME = "bad frame"
    """It sent a frame that is not one (head and node versions differ, or a bug)."""
    NO_ANSWER = "no answer"
    """Nothing by the deadline: its channel was killed."""


@dataclass
class NodeResult:
    """One node's outcome: the frames it answered with, or why it has none."""

    host: str
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The first frame of each kind asked for, by kind."""
    came: dict[str, tuple[float, float]] = field(default_factory=dict)
    """When each of those came: (monotonic, wall clock) on the head."""
    why: Why | None = None
    problem: Problem | None = None
    """What went wrong and the fix (who: None, the node is ``host``), with ``why``."""
    exit_code: int | None = None
    stderr: list[str] = field(default_factory=list)
    """The tail of its program's stderr (ssh's own words among it), once it ended."""


@dataclass
class GroupResult:
    """Every node's :class:`NodeResult`, in the order asked; ``answer`` is the frame kind that
    makes a node count as answered."""

    answer: str
    nodes: dict[str, NodeResult]

    @property
    def succeeded(self) -> dict[str, NodeResult]:
        return {h: r for h, r in self.nodes.items() if self.answer in r.answers}

    @property
    def failed(self) -> dict[str, NodeResult]:
        """The nodes without the answer, each with its ``why``, ``problem`` and ``fix``."""
        return {h: r for h, r in self.nodes.items() if self.answer not in r.answers}


class _Ev(Enum):
    FRAME, BAD, CLOSED, NOT_STARTED = range(4)


_Event = tuple[str, _Ev, Any, float, float]
"""(host, what, its payload, monotonic and wall time it came) from the hub's thread."""


class Group:
    """One channel per member running ``program``; the frames of ``kinds`` (``answer`` among
    them) collected per node. Only the caller's thread touches the results: the channels'
    callbacks queue what happened and ``wait``/``close`` apply it."""

    def __init__(self, members: Sequence[Member], program: Program, *, answer: str,
                 kinds: Iterable[str] = (), heartbeat: float | None = None) -> None:
        """``heartbeat``: seconds between the head's heartbeats to each node (None: none; a
        program that ends when the head is silent asks for them)."""
        self._kinds = {answer, *kinds}
        self._events: queue.Queue[_Event] = queue.Queue()
        self._python = {m.host: m.python for m in members}
        self.result = GroupResult(answer, {m.host: NodeResult(m.host) for m in members})
        channels = [NodeChannel(m.transport, m.python, program, m.config,
                                on_frames=partial(self._frames, m.host),
                                on_closed=partial(self._closed, m.host),
                                heartbeat=heartbeat) for m in members]
        self.channels = {c.host: c for c in start_all(channels, self._not_started)}
        """The channels started (or waiting for their turn in the window), by host."""
        self.begun = time.monotonic()
        self._ended: set[str] = set()
        """The nodes whose channel ended (or never started): their outcome is all here."""
        while not self._events.empty():  # (those that could not start at once said so here)
            self._apply(self._events.get_nowait())

    # -- the hub's thread ---------------------------------------------------------------------
    def _frames(self, host: str, lines: list[str]) -> None:
        for line in lines:
            kind, payload = split(line)
            if kind not in self._kinds:
                continue
            mono, wall = time.monotonic(), time.time()
            try:
                self._events.put((host, _Ev.FRAME, (kind, control(payload)), mono, wall))
            except ValueError as exc:
                self._events.put((host, _Ev.BAD, f"{kind}: {exc}", mono, wall))

    def _closed(self, host: str, code: int | None, stderr: list[str]) -> None:
        self._events.put((host, _Ev.CLOSED, (code, stderr), time.monotonic(), time.time()))

    def _not_started(self, channel: NodeChannel, said: Problem) -> None:
        self._events.put((channel.host, _Ev.NOT_STARTED, said, time.monotonic(), time.time()))

    # -- the caller's thread ------------------------------------------------------------------
    def send(self, host: str, kind: str, payload: Mapping[str, object] | None = None, *,
             raw: int = 0) -> None:
        self.channels[host].send(kind, payload, raw=raw)

    def alive(self, host: str) -> bool:
        """``host`` was started and its channel has not ended."""
        channel = self.channels.get(host)
        return channel is not None and not channel.closed

    def wait(self, kind: str, timeout: float, *, hosts: Iterable[str] | None = None,
             late: Problem | None = None) -> None:
        """Until every node of ``hosts`` (default: every one started) has sent ``kind``, ended
        or failed, or ``timeout`` s. The nodes still silent then are killed; those without the
        answer fail with ``late`` (default: "no answer within T s")."""
        pending = set(self.channels if hosts is None else hosts)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._late(pending, late or Problem(None, f"no answer within {timeout:.0f} s",
                                                    LATE_FIX))
                return
            try:
                event = self._events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            host, what, payload = event[:3]
            self._apply(event)
            if what is not _Ev.FRAME or payload[0] == kind:
                pending.discard(host)

    def close(self, *, bye: str | None = None, timeout: float = CLOSE_TIMEOUT) -> GroupResult:
        """``bye`` (a frame kind) to every node if given, then EOF and one deadline for all;
        the result, every node that has no answer with its reason."""
        if bye is not None:
            for channel in self.channels.values():
                channel.send(bye)
        close_all(list(self.channels.values()), timeout=timeout)
        # (a channel is closed just before its on_closed runs: its exit status may be on its way)
        until = time.monotonic() + 1.0
        while not set(self.channels) <= self._ended and time.monotonic() < until:
            try:
                event = self._events.get(timeout=0.05)
            except queue.Empty:
                continue
            if event[1] in (_Ev.CLOSED, _Ev.NOT_STARTED):  # (answers now come too late)
                self._apply(event)
        for host, r in self.result.nodes.items():
            if r.why is None and self.result.answer not in r.answers:
                r.why = Why.CLOSED
                r.problem = explain_channel_failure(r.stderr, r.exit_code, self._python[host])
        return self.result

    def _apply(self, event: _Event) -> None:
        host, what, payload, mono, wall = event
        r = self.result.nodes[host]
        if what is _Ev.FRAME:
            kind, answer = payload
            if kind not in r.answers:
                r.answers[kind], r.came[kind] = answer, (mono, wall)
            return
        if what in (_Ev.CLOSED, _Ev.NOT_STARTED):
            self._ended.add(host)
        if what is _Ev.CLOSED:
            r.exit_code, r.stderr = payload
        elif r.why is None:
            r.why = Why.NOT_STARTED if what is _Ev.NOT_STARTED else Why.BAD_FRAME
            r.problem = payload if what is _Ev.NOT_STARTED else Problem(
                None, f"the node sent a bad frame ({payload})",
                "report this bug: ptcluster versions may differ between head and node")

    def _late(self, hosts: Iterable[str], late: Problem) -> None:
        for host in hosts:
            r = self.result.nodes[host]
            if r.why is None and self.result.answer not in r.answers:
                r.why, r.problem = Why.NO_ANSWER, late
            channel = self.channels.get(host)
            if channel is not None:
                channel.signal(signal.SIGKILL)


def ask_all(members: Sequence[Member], program: Program, answer: str, timeout: float, *,
            late: Problem | None = None, bye: str | None = None) -> GroupResult:
    """Start ``program`` on every member, wait up to ``timeout`` s for each one's ``answer``
    frame, close them all: every node's outcome (``.succeeded``, ``.failed``)."""
    group = Group(members, program, answer=answer)
    try:
        group.wait(answer, timeout, late=late)
    finally:
        result = group.close(bye=bye)
    return result
