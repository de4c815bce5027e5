"""What the runner reads of a supervisor: one read-only, always current view."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ptcluster.launch.result import Failure, NodeOutcome, RankRecord
from ptcluster.launch.supervise.states import NodeState, Phase

if TYPE_CHECKING:
    from ptcluster.launch.supervise.supervisor import Supervisor


class SupervisorView:
    """All the runner reads of a supervisor: read-only, always current."""

    def __init__(self, sup: Supervisor) -> None:
        self._sup = sup

    @property
    def done(self) -> bool:
        """Every node STOPPED or LOST: the attempt is over."""
        return self._sup.done

    @property
    def phase(self) -> Phase:
        return self._sup.phase

    @property
    def killed_by(self) -> str:
        """``ended by `ptcluster kill` from HOST (user)``, or ""."""
        return self._sup.killed_by

    @property
    def master_port(self) -> int:
        """The rendezvous port in use (``auto``: the one the master's guard took; 0 before)."""
        return self._sup.master_port

    @property
    def stopping(self) -> bool:
        """The job is being (or was) stopped: a node's lines are logged, not shown."""
        return self._sup.stopping

    @property
    def askable(self) -> list[str]:
        """Nodes whose ranks may be asked for stacks: ready or running, not told to stop."""
        return [h for h, life in self._sup.life.items()
                if life.state in (NodeState.READY, NodeState.RUNNING)]

    @property
    def interrupted(self) -> bool:
        return self._sup.interrupted

    @property
    def cut_off(self) -> list[str]:
        return self._sup.cut_off

    @property
    def failures(self) -> list[Failure]:
        """Every failure, earliest first: the root cause is the first."""
        return self._sup.ordered_failures()

    @property
    def ranks(self) -> list[RankRecord]:
        return [self._sup.ranks[r] for r in sorted(self._sup.ranks)]

    @property
    def nodes(self) -> list[NodeOutcome]:
        """In the plan's order."""
        return [self._sup.nodes[n.host] for n in self._sup.plan.nodes]

    @property
    def checkpoint(self) -> int | None:
        return self._sup.checkpoint

    @property
    def resumed_from(self) -> int | None:
        return self._sup.resumed_from

    @property
    def straggler(self) -> dict[str, Any]:
        """The straggler report's current figures (``StragglerWatch.to_json``)."""
        return self._sup.straggler.to_json()

    @property
    def first_rank_start(self) -> float | None:
        return self._sup.first_rank_start
