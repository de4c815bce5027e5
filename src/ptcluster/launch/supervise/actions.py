"""What the supervisor tells the runner to do: the whole seam between the two, as data.

The supervisor returns a list of these for every input (an event, a tick, a stop request); the
runner applies them in order and decides nothing of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ptcluster.launch.supervise import events as ev


@dataclass(frozen=True)
class Send:
    """A frame to a node's guard (``wire.Kind.GO``, ``wire.Kind.STOP``)."""

    host: str
    kind: str
    payload: dict[str, Any] | None = None


@dataclass(frozen=True)
class SignalChannel:
    """Signal the process of a node's channel (SIGTERM, SIGKILL: cut it)."""

    host: str
    sig: int


@dataclass(frozen=True)
class Status:
    """A note for the user."""

    text: str


HANG = "hang"
"""The purpose of the collection asked for on a hang (``CollectStacks(HANG)``): its report is
the run directory's hang report and goes to ``hang_reported``; any other purpose is a reason given
by whoever asked (``ptcluster stacks``)."""


@dataclass(frozen=True)
class CollectStacks:
    """Collect every rank's stacks; for ``HANG``, hand the report to ``hang_reported``."""

    purpose: str


@dataclass(frozen=True)
class NodeLine:
    """A line of the node itself (torchrun, ssh, a frame that makes no sense): always logged,
    shown when ``show`` (not while the job is being stopped: tracebacks about our own SIGTERM
    are noise)."""

    host: str
    text: str
    show: bool


@dataclass(frozen=True)
class DeliverData:
    """A record a rank program reported, for the caller's data sink."""

    host: str
    rank: int
    data: dict[str, Any]


@dataclass(frozen=True)
class StacksAnswered:
    """A guard's answer to a stacks collection, for the collector."""

    reply: ev.StacksReply


Action = Send | SignalChannel | Status | CollectStacks | NodeLine | DeliverData | StacksAnswered
