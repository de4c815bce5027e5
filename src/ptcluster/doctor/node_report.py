"""What the doctor knows of one node (:class:`NodeReport`: its facts, or why it has none) and
the pure reading of those facts the checks share. No I/O here: ``doctor.collect`` fills the
reports, ``doctor.checks`` judges them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ptcluster.cluster.model import NodeSpec
from ptcluster.errors import Problem
from ptcluster.node.doctor_facts import Connect, DoctorFacts


class ProblemKind(str, Enum):
    """Why a node has no facts, as far as the checks need to tell."""

    PYTHON = "python"
    """ssh worked, the node's shell could not run the interpreter (exit status 126 or 127)."""
    SSH = "ssh"
    """ssh itself failed: key refused, host key, unreachable... (exit status 255)."""
    COMMAND = "command"
    """The facts program started and failed (any other exit status)."""
    NO_ANSWER = "no answer"
    """No exit status: the channel could not be started, or was killed after the timeout."""


@dataclass(kw_only=True)
class NodeReport:
    host: str
    facts: DoctorFacts | None = None
    """The node's doctor facts, checked as they arrived (``remote.node_replies``)."""
    problem: Problem | None = None
    """Why there are no facts (ssh refused, python missing, timed out...): who None, the node
    is ``host``."""
    exit_code: int | None = None
    ssh_s: float | None = None
    """Seconds from starting ssh to the node's facts (connect + facts)."""
    clock_offset: float | None = None
    """Node clock minus head clock, seconds (one-way latency uncertainty)."""
    connects: list[Connect] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.facts is not None

    @property
    def kind(self) -> ProblemKind | None:
        """What went wrong, from the exit status (the shell's 126/127, ssh's 255), not from the
        wording of ``problem``; None when the node answered."""
        if self.ok:
            return None
        if self.exit_code in (126, 127):
            return ProblemKind.PYTHON
        if self.exit_code == 255:
            return ProblemKind.SSH
        if self.exit_code is None or self.exit_code < 0:
            return ProblemKind.NO_ANSWER
        return ProblemKind.COMMAND


def interface_of(node: NodeSpec, facts: DoctorFacts, master_addr: str) -> str | None:
    """The interface NCCL/Gloo will use on this node: configured, else what the node's facts program
    decided with the guard's own rule (``node.facts.netif.route_interface``)."""
    if node.interface:
        return node.interface
    master = facts.get("master")
    return master.get("interface") or None if master else None


def address_of(iface: str | None, facts: DoctorFacts) -> str | None:
    for entry in facts.get("interfaces", []):
        if entry["name"] == iface and entry["ipv4"]:
            return str(entry["ipv4"][0].split("/")[0])
    return None
