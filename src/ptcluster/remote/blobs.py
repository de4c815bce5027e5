"""Files to many nodes on their channels, by digest: the head side of ``node.blobs``.

Each file goes raw on a node's channel after its ``blob`` frame (the one transport every
connector has: ssh, srun, local; base64 in JSON would send a third more), a megabyte at a time,
at most ``WINDOW`` bytes queued per node (a whole file is never held in a node's queue: the
head's memory stays bounded however large the file), round-robin over the nodes from the
caller's one thread.
The project's environment (``venvs.ship``) sends wheels so and ``ptcluster push`` data files.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ptcluster.node.wire import Kind
from ptcluster.remote.group import Group

CHUNK = 1 << 20
WINDOW = 4 << 20
"""Bytes queued per node at most."""
TICK = 0.25
"""Seconds between two progress calls while files are on their way."""


@dataclass(frozen=True)
class Blob:
    """One file to send: where the head has it, its size, and its ``blob`` frame's payload
    (``sha256``, ``size`` and what the node program needs besides)."""

    path: Path
    size: int
    frame: dict[str, Any]


@dataclass
class Outgoing:
    """What is left to send one node, and what went."""

    blobs: deque[Blob]
    total: int = 0
    sent: int = 0
    count: int = 0
    current: IO[bytes] | None = None
    left: int = 0
    done: list[Blob] = field(default_factory=list)

    @classmethod
    def of(cls, blobs: list[Blob]) -> Outgoing:
        return cls(deque(blobs), total=sum(b.size for b in blobs))


Tick = Callable[[str, Outgoing], None]


def stream(group: Group, sending: dict[str, Outgoing], *, tick: Tick | None = None,
           finished: Tick | None = None) -> None:
    """Every node's files, round-robin, until each is sent or its channel ended (a node whose
    channel ended is dropped: its outcome says why). ``tick(host, state)`` every ``TICK`` s for
    each node still sending; ``finished(host, state)`` once a node's last byte is queued."""
    active = [h for h, s in sending.items() if s.blobs]
    told = time.monotonic()
    try:
        while active:
            if tick is not None and time.monotonic() - told >= TICK:
                told = time.monotonic()
                for host in active:
                    tick(host, sending[host])
            moved = False
            for host in list(active):
                more, sent = _fill(group, host, sending[host])
                moved = moved or sent
                if not more:
                    active.remove(host)
                    if finished is not None and not group.channels[host].closed:
                        finished(host, sending[host])
            if not moved:
                time.sleep(0.002)
    finally:
        for state in sending.values():
            if state.current is not None:
                state.current.close()
                state.current = None


def _fill(group: Group, host: str, state: Outgoing) -> tuple[bool, bool]:
    """Queue ``host``'s next bytes up to the window: (anything left to send, anything queued)."""
    channel = group.channels[host]
    moved = False
    while not channel.closed and channel.queued < WINDOW:
        if state.current is None:
            if not state.blobs:
                return False, moved
            blob = state.blobs.popleft()
            state.current, state.left = open(blob.path, "rb"), blob.size
            group.send(host, Kind.BLOB, blob.frame, raw=blob.size)
            state.count += 1
            state.done.append(blob)
        want = min(CHUNK, state.left)
        data = state.current.read(want)
        if len(data) < want:  # the head's file shrank: the node's digest check says so
            data += b"\0" * (want - len(data))
        channel.send_raw(data)
        state.left -= len(data)
        state.sent += len(data)
        moved = True
        if not state.left:
            state.current.close()
            state.current = None
    return not channel.closed, moved
