"""What the runner reads of a supervisor (transitional: the supervisor's own read-only
properties, ``JobState``, replace it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ptcluster.launch.result import Failure, NodeOutcome, RankRecord
from ptcluster.launch.supervise.states import Phase

if TYPE_CHECKING:
    from ptcluster.launch.supervise.supervisor import Supervisor


class SupervisorView:
    """All the runner reads of a supervisor: read-only, always current."""

    def __init__(self, sup: Supervisor) -> None:
        self._sup = sup

    @property
    def done(self) -> bool:
        return self._sup.done

    @property
    def phase(self) -> Phase:
        return self._sup.phase

    @property
    def killed_by(self) -> str:
        return self._sup.killed_by

    @property
    def master_port(self) -> int:
        return self._sup.master_port

    @property
    def stopping(self) -> bool:
        return self._sup.stopping

    @property
    def askable(self) -> list[str]:
        return self._sup.askable

    @property
    def interrupted(self) -> bool:
        return self._sup.interrupted

    @property
    def cut_off(self) -> list[str]:
        return self._sup.cut_off

    @property
    def failures(self) -> list[Failure]:
        return self._sup.failures

    @property
    def ranks(self) -> list[RankRecord]:
        return self._sup.ranks

    @property
    def nodes(self) -> list[NodeOutcome]:
        return self._sup.nodes

    @property
    def checkpoint(self) -> int | None:
        return self._sup.checkpoint

    @property
    def resumed_from(self) -> int | None:
        return self._sup.resumed_from

    @property
    def straggler(self) -> dict[str, Any]:
        return self._sup.straggler_figures()

    @property
    def first_rank_start(self) -> float | None:
        return self._sup.first_rank_start
