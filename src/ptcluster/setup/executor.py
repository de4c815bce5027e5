"""What a phase of ``ptcluster setup`` may use of the run it is part of: the public surface of
``setup.apply.Setup``, as a Protocol, so that a phase defined elsewhere (``setup.slurm_apply``:
``--slurm``'s cluster-wide phase and its proof) reaches the nodes through the executor and never
through its privates, and imports nothing of ``setup.apply`` (which imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ptcluster.cluster.model import ClusterSpec, NodeSpec, SlurmSetupSpec
from ptcluster.node.facts.setup_facts import SetupFacts
from ptcluster.setup.options import SetupOptions
from ptcluster.setup.report import NodeSetupOutcome
from ptcluster.setup.steps import ClusterFacts, StepAction

Event = Callable[[str, str], None]
"""``(host, text)``: a line of progress about a node ("head" for the head's own)."""


class Executor(Protocol):
    """One setup run over every node: its inputs, its facts, its outcomes, and how it acts."""

    spec: ClusterSpec
    opts: SetupOptions
    slurm: SlurmSetupSpec | None
    """What Slurm the nodes get; None: none."""
    outcomes: dict[str, NodeSetupOutcome]
    """host -> what happened there so far (``problem`` set: the node is out of the run)."""
    facts: dict[str, SetupFacts | None]
    """host -> its facts as last read (None: not reached)."""
    slurm_removed: dict[str, list[Any]]
    """Nodes gone from the cluster file: ``removed`` and ``draining`` (``slurm_apply``)."""
    on_event: Event

    @property
    def cluster(self) -> ClusterFacts:
        """What every node's plan depends on beyond its own facts."""

    @cluster.setter
    def cluster(self, value: ClusterFacts) -> None: ...

    def reached(self, host: str) -> bool:
        """Whether ``host`` has a session (its facts were read)."""

    def refresh(self, host: str, sections: list[str]) -> None:
        """Read ``sections`` of ``host``'s facts again, into ``facts[host]``."""

    def act(self, host: str, action: StepAction) -> tuple[bool, str]:
        """Run one command on ``host`` (or copy to it): (succeeded, its output)."""

    def each(self, work: Callable[[NodeSpec], None], label: str | None = None, *,
             selected: bool = False, hosts: set[str] | None = None) -> None:
        """``work`` on every node in parallel (those still in the run; ``selected``: only the
        ``--node`` ones; ``hosts``: only these), timed under ``label`` in each outcome's
        ``seconds`` when one is given; one node's failure is its own outcome."""

    def apply_phase(self, node: NodeSpec, phase: int) -> None:
        """Apply ``node``'s steps of ``phase`` (``StepDef.phase``)."""
