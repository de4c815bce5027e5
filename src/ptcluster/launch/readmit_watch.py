"""``run --readmit``'s eyes: while an attempt runs, the nodes lost in earlier attempts are asked
every ``EVERY`` s whether they answer again (``lost.probe``, with the health gate's verdict),
from one thread of the runner's; what it finds goes to the attempt's loop as a
:class:`NodeBack` on the run's event queue (the supervisor decides, ``Supervisor.node_back``).

Each node's verdict is said once (and again only when it changes): taken back at the next
checkpoint every rank saved (fit, and a place the job lost is free), refused by its health gate
(asked again at the next look), failed twice in this run (the restart rule's two strikes: never
taken back), or waiting as a spare because a spare holds its place (the job never grows past
the cluster file's nodes; the next restart that frees a place takes it first).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ptcluster.launch.lost import PROBE_BOUND, back, probe
from ptcluster.launch.result import NodeOutcome
from ptcluster.node.facts.health import Unfit
from ptcluster.node.facts.health_facts import HealthContext
from ptcluster.remote.transport import Transport

log = logging.getLogger(__name__)

EVERY = 3.0
"""Seconds between two looks at the lost nodes (each look: an ssh connection per node, at most
``lost.PROBE_BOUND`` s for one that does not answer)."""


@dataclass(frozen=True)
class NodeBack:
    """A lost node answers again: ``refused`` says why it is not taken back ("" : it is fit
    and has a place, so a planned restart takes it back)."""

    host: str
    refused: str = ""


@dataclass(frozen=True)
class Watched:
    """What the watch needs of the run: the lost nodes (each with its outcome where it was
    lost), their interpreters and health contexts, the job id, the transports."""

    away: Sequence[NodeOutcome]
    python: Mapping[str, str]
    health: Mapping[str, HealthContext]
    job_id: str
    transports: Mapping[str, Transport]
    twice: frozenset[str]
    """Nodes that were the cause of two attempts: never taken back."""
    room: int
    """Places the job lost that a node back may fill (0: spares hold them all)."""


class ReturnWatch:
    """Probes ``watched.away`` every ``every`` s on its own thread until ``stop``; ``post`` gets
    each :class:`NodeBack` (called on that thread: it only queues)."""

    def __init__(self, watched: Watched, post: Callable[[NodeBack], None],
                 every: float = EVERY) -> None:
        self._w, self._post, self._every = watched, post, every
        self._said: dict[str, str] = {}
        self._taken = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ptcluster-readmit", daemon=True)

    def start(self) -> ReturnWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the watch; waits for a look under way (at most ``lost.PROBE_BOUND`` s), so that
        no probe of it outlives the run."""
        self._stopped.set()
        self._thread.join(timeout=2 * PROBE_BOUND)

    def _run(self) -> None:
        while not self._stopped.wait(self._every):
            left = [n for n in self._w.away  # (a refused one may become fit: asked again)
                    if self._said.get(n.host) not in ("", "twice", "spare")]
            if not left:
                return
            try:
                answers = probe(left, self._w.python, self._w.job_id, self._w.transports,
                                self._w.health)
            except Exception:  # noqa: BLE001 - a look that failed is tried again at the next
                log.debug("probing the lost nodes failed", exc_info=True)
                continue
            for node in left:
                answer = back(answers.get(node.host))
                if answer is not None:
                    self._verdict(node.host, answer.get("unfit"))

    def _verdict(self, host: str, unfit: Unfit | None) -> None:
        """Say (post) what becomes of ``host``, once per verdict."""
        if host in self._w.twice:
            refused, key = "failed twice in this run: it is not taken back", "twice"
        elif unfit is not None:
            refused = f"its health gate refuses it ({unfit['what']}; fix: {unfit['fix']})"
            key = refused
        elif self._taken >= self._w.room:
            refused = ("a spare holds its place: it waits as a spare (the job never grows past "
                       "the cluster file's nodes; a restart that frees a place takes it first)")
            key = "spare"
        else:
            refused = key = ""
            self._taken += 1
        if self._said.get(host) != key:
            self._said[host] = key
            self._post(NodeBack(host, refused))
