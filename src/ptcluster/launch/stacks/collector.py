"""Stacks collections on the head: asked of the nodes, answered by their guards, reported.

The runner starts one when the supervisor says so (a hang) or ``ptcluster stacks`` asks through
the control socket; each guard answers with its ranks' raw dumps (``node.guard.progress``); a
collection is complete when every node asked has answered or ``STACKS_WAIT`` passed (a node that
did not answer is named in the report). Reports are saved in the run directory.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptcluster.control.protocol import Answer, StacksAnswer
from ptcluster.launch.stacks.report import StackReport, build_report
from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.actions import HANG
from ptcluster.rundir import RunDir, write_private

STACKS_WAIT = 10.0
"""Seconds a collection waits for every node's answer (a guard needs <= 2.5 s, plus <= 6 s
when it runs py-spy)."""


@dataclass
class _Collection:
    purpose: str
    reason: str
    hosts: set[str]
    deadline: float
    replies: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    waiters: list[queue.Queue[Answer]] = field(default_factory=list)


class StackCollector:
    def __init__(self, run_dir: Path, on_status: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self._layout = RunDir(run_dir)
        self.on_status = on_status
        self.pending: dict[int, _Collection] = {}
        self._last = 0

    def start(self, purpose: str, reason: str, hosts: set[str],
              send: Callable[[str, dict[str, Any]], None],
              waiter: queue.Queue[Answer] | None = None) -> None:
        """Ask ``hosts`` (``send(host, payload)`` sends the ``stacks`` frame); no host: the
        report (an empty one) is made at the next ``finish``."""
        self._last += 1
        collection = _Collection(purpose, reason, set(hosts), time.monotonic() + STACKS_WAIT)
        if waiter is not None:
            collection.waiters.append(waiter)
        self.pending[self._last] = collection
        for host in hosts:  # native frames (py-spy pauses each rank) only for a hang
            send(host, {"id": self._last, "native": purpose == HANG})

    def reply(self, e: ev.StacksReply) -> None:
        collection = self.pending.get(e.id) if e.id is not None else None
        if collection is not None and e.host in collection.hosts:
            collection.replies[e.host] = e.ranks

    def finish(self, now: float) -> list[tuple[str, StackReport]]:
        """(purpose, report) of every collection complete by now; saved, waiters answered."""
        done = []
        for ident, c in list(self.pending.items()):
            if not c.hosts <= c.replies.keys() and now < c.deadline:
                continue
            del self.pending[ident]
            report = build_report(c.replies.items(), reason=c.reason, at=time.time(),
                                  missing=sorted(c.hosts - c.replies.keys()))
            saved, as_json = self._layout.stacks_report(
                RunDir.HANG_STACKS if c.purpose == HANG else
                RunDir.stacks_stem(ident, time.strftime("%H%M%S")))
            data = report.to_json()
            try:
                write_private(saved, "\n".join(report.lines()) + "\n")
                write_private(as_json, json.dumps(data, indent=2))
            except OSError as exc:
                self.on_status(f"the stacks report could not be saved in {self.run_dir}: {exc}")
            answer: StacksAnswer = {"ok": True, "report": data, "lines": report.lines(),
                                    "saved": str(saved)}
            for waiter in c.waiters:
                waiter.put(answer)
            done.append((c.purpose, report))
        return done

    def abandon(self) -> None:
        """The job ended: whoever still waits gets an answer."""
        ended: StacksAnswer = {"ok": False, "error": "the job ended before every node answered"}
        for collection in self.pending.values():
            for waiter in collection.waiters:
                waiter.put(ended)
        self.pending.clear()

