"""What ``ptcluster setup`` did: each node's outcome (plans before and after, what was applied)
and the whole report, as the CLI renders it and as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from ptcluster.errors import Problem
from ptcluster.setup import plan as P
from ptcluster.setup import steps as S
from ptcluster.setup.torch_choice import TorchChoice


class TrainerProof(TypedDict, total=False):
    """The reference trainer's job (``--slurm-proof trainer``), read from Slurm and from the
    run's own ``summary.json`` (never from the trainer's printed lines)."""

    ok: bool
    job_id: str | None
    state: str
    """Slurm's ``JobState``."""
    log: str | None
    """Slurm's log of the job on the controller."""
    outcome: str | None
    """The run's ``outcome`` (``summary.json``): ``succeeded`` when it proves anything."""
    world_size: int
    nodes: list[str]
    """The hosts its ranks ran on."""
    final: str
    """One line for the report: what the summary says."""
    problem: str


class SlurmProof(TypedDict, total=False):
    """``setup --slurm``'s proof (``verify``): every node idle, one ``srun`` on all of them,
    and the trainer; ``removed``/``draining``: nodes gone from the cluster file."""

    ok: bool
    controller: str
    nodes: list[str]
    sinfo: str
    idle_s: float
    job_id: str | None
    ran_on: list[str]
    seconds: float
    trainer: TrainerProof
    problem: str
    retried: str
    """The first ``srun``'s failure, where it was tried again (``slurm_apply.SRUN_TRIES``)."""
    removed: list[str]
    draining: list[dict[str, Any]]



@dataclass
class NodeSetupOutcome:
    """One node's setup: how the head got in, its plan before and after, what apply did."""

    host: str
    addr: str = ""
    connection: str = ""
    """How the head got in: ``key``, ``password``, or why it could not."""
    before: list[S.Step] = field(default_factory=list)
    """The plan from the first facts."""
    after: list[S.Step] = field(default_factory=list)
    """The plan from the facts after apply (empty in a dry run)."""
    applied: list[tuple[str, str, str]] = field(default_factory=list)
    """(step, changed | failed | skipped, detail) for every step apply looked at."""
    problem: Problem | None = None
    """Why setup stopped on this node (who: None, the node is ``host``)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where the time went: ``facts``, each applied step, ``confirm``."""

    @property
    def final(self) -> list[S.Step]:
        return self.after or self.before

    @property
    def converged(self) -> bool:
        return self.problem is None and bool(self.final) and not P.pending(self.final)

    def to_json(self) -> dict[str, Any]:
        said = self.problem
        return {"host": self.host, "addr": self.addr, "connection": self.connection,
                "problem": None if said is None else said.what,
                "fix": None if said is None else said.fix,
                "code": None if said is None else said.code,
                "fields": {} if said is None else said.fields, "converged": self.converged,
                "plan": [s.to_json(self.host) for s in self.before],
                "applied": [{"step": s, "result": r, "detail": d} for s, r, d in self.applied],
                "after": [s.to_json(self.host) for s in self.after],
                "seconds": {k: round(v, 2) for k, v in self.seconds.items()}}


@dataclass
class SetupReport:
    nodes: dict[str, NodeSetupOutcome]
    head: list[S.Step]
    torch: TorchChoice | None
    dry_run: bool
    duration: float = 0.0
    wheelhouse_s: float | None = None
    """Seconds the head spent preparing its wheelhouse (None: not needed)."""
    slurm: SlurmProof | None = None
    """``--slurm``'s proof (``setup.slurm_apply.verify``): sinfo, the job; None: not asked."""

    @property
    def converged(self) -> bool:
        return all(n.converged for n in self.nodes.values()) and not P.pending(self.head) \
            and (self.slurm is None or bool(self.slurm.get("ok")))

    @property
    def changes(self) -> int:
        """The steps apply changed, on every node (the summary's "N change(s) made")."""
        return sum(r == "changed" for n in self.nodes.values() for _, r, _ in n.applied)

    @property
    def pending(self) -> list[str]:
        """The nodes reached whose plan still has a step that is not ok (a dry run's "N
        node(s) with changes pending")."""
        return [h for h, n in self.nodes.items() if n.problem is None and P.pending(n.final)]

    def to_json(self) -> dict[str, Any]:
        t = self.torch
        return {"dry_run": self.dry_run, "converged": self.converged,
                "duration_s": round(self.duration, 2), "wheelhouse_s": self.wheelhouse_s,
                "changes": self.changes, "pending": self.pending,
                "head": [s.to_json("head") for s in self.head],
                "torch": None if t is None else {"version": t.version, "variant": t.variant,
                                                 "why": t.why, "problem": (
                                                     None if t.problem is None
                                                     else t.problem.what)},
                "nodes": [n.to_json() for n in self.nodes.values()], "slurm": self.slurm}

