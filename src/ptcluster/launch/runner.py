"""Runs a :class:`LaunchPlan`: every attempt of the job (``launch.attempt``), ``--wait``'s
retries while other jobs hold what it asks for, restarts (``--max-restarts``, the rule in
``supervise.restart``), the run directory (``plan.json``, ``summary.json``) and the control
socket (``control.server``) for the whole run -> a :class:`RunResult`.
"""

from __future__ import annotations

import queue
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ptcluster.cluster.model import ClusterSpec, NodeSpec
from ptcluster.control.server import ControlServer, HeadDoor
from ptcluster.launch.attempt import (
    ANY_ATTEMPT,
    Attempt,
    DataSink,
    LineSink,
    RunContext,
    Sinks,
    StatusSink,
    Stops,
)
from ptcluster.launch.lost import answering_again
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import (
    LaunchPlan,
    Target,
    health_context,
    plan_json,
    replan,
    restart_port,
)
from ptcluster.launch.port import free_port
from ptcluster.launch.readmit_watch import ReturnWatch, Watched
from ptcluster.launch.result import AttemptRecord, Failure, FailureKind, NodeOutcome, RunResult
from ptcluster.launch.runlogs import RunLogs, log_files_budget
from ptcluster.launch.stacks.collector import StackCollector
from ptcluster.launch.supervise.restart import (
    GONE,
    Decision,
    RestartPolicy,
    decide,
    restarts_used,
)
from ptcluster.launch.supervise.supervisor import Supervisor
from ptcluster.node import WARM
from ptcluster.node.guard.refusal import POOL_LOST
from ptcluster.node.rank_wire import MAX_RESTARTS_VAR
from ptcluster.node.warm.pools import PoolsConfig
from ptcluster.node.wire import Kind
from ptcluster.remote.group import Member, ask_all
from ptcluster.remote.transport import Transport
from ptcluster.rundir import RunDir

__all__ = ["DataSink", "LineSink", "Restarts", "Runner"]

KEPT_POOLS_WAIT = 10.0
"""Seconds the nodes have to end the warm pools kept for a restart that does not follow."""


@dataclass(frozen=True)
class Restarts:
    """How a failed attempt is followed by another (``run --max-restarts``): ``policy`` says
    whether, ``plan.replan`` plans it (the same ``target`` on the nodes of ``spec`` that
    remain)."""

    policy: RestartPolicy
    spec: ClusterSpec
    target: Target

    def next_plan(self, first: LaunchPlan, attempt: int, hosts: tuple[str, ...],
                  addresses: dict[str, str]) -> LaunchPlan:
        """Attempt ``attempt`` on ``hosts`` (each node's address as its guard reported it): on
        the local cluster at a port free now, else at ``plan.restart_port``."""
        port = free_port() if self.spec.local else restart_port(first.master_port, attempt)
        return replan(self.spec, self.target, job_id=first.job_id, attempt=attempt,
                      hosts=hosts, addresses=addresses, port=port,
                      max_restarts=self.policy.max_restarts)


@dataclass(frozen=True)
class Reshipped:
    """The project's environment shipped and built after a guard found it missing or changed
    (``venvs.runenv``): the same job's plan on the spec that has it, and ``summary.json``'s
    ``environment``."""

    plan: LaunchPlan
    spec: ClusterSpec
    environment: dict[str, Any]


Reship = Callable[[LaunchPlan], Reshipped]
"""Ships and builds the environment where a guard refused for it (``PtclusterError`` when a
node cannot get it): the plan to launch instead of ``LaunchPlan``."""


def _next_hosts(plan: LaunchPlan, file_nodes: tuple[NodeSpec, ...],
                decision: Decision) -> tuple[str, ...]:
    """The next attempt's hosts in rank order: the file's nodes that go on or are taken back,
    in file order; then the spares that go on; then the spares that take places now."""
    going_on = [n.host for n in plan.nodes if n.host not in decision.drop]
    ours = {n.host for n in file_nodes}
    nodes = [n.host for n in file_nodes if n.host in going_on or n.host in decision.readmit]
    return tuple(nodes + [h for h in going_on if h not in ours] +
                 [spare for _, spare in decision.replace])


def _size_change(before: LaunchPlan, after: LaunchPlan, decision: Decision) -> str:
    """After the world size of a restart that put spares in: whether it stayed, and, when not,
    whose slots differ (a spare runs with its own ``slots``)."""
    if not decision.replace and not decision.readmit:
        return ""
    if after.world_size == before.world_size:
        return " (the same" + (": the spares' slots match)" if decision.replace else ")")
    slots = {n.host: n.nproc for n in before.nodes + after.nodes}
    differ = [f"{spare} has {slots[spare]} slot(s), {node} had {slots[node]}"
              for node, spare in decision.replace if slots[spare] != slots[node]]
    differ += [f"{h} taken back" for h in decision.readmit]
    return f" (was {before.world_size}: {', '.join(differ) or 'nodes were left out'})"


class Notes:
    """The run's status notes (``on_status``), given to everything that has some to say (the
    logs, the stacks collector, each attempt) once. Under ``--wait`` each try's are held until
    its first rank starts or it ends: shown then (``release``), or dropped if it is tried
    again (``drop``): a refusal because others hold the GPUs or the port is not a failure
    there, and its teardown ("stopping the job on every node: ... Fix: ... (run --wait)") is
    not news; the one line ``waiting (--wait, no queue): ...`` says it."""

    def __init__(self, show: StatusSink) -> None:
        self._show = show
        self._held: list[str] | None = None

    def __call__(self, text: str) -> None:
        if self._held is not None:
            self._held.append(text)
        else:
            self._show(text)

    def hold(self) -> None:
        self._held = []

    def release(self) -> None:
        held, self._held = self._held or [], None
        for text in held:
            self._show(text)

    def drop(self) -> None:
        self._held = None


class Runner:
    """Runs ``plan`` (and the restarts ``restarts`` allows) from this machine: ``run`` ->
    the :class:`RunResult`. ``on_line`` gets every output line, ``on_status`` the notes for the
    user, ``on_data`` the records rank programs report (``Sinks``); ``request_stop`` is the
    one thing another thread or a signal handler may call."""

    def __init__(self, plan: LaunchPlan, transports: dict[str, Transport], run_dir: Path,
                 on_line: LineSink | None = None, on_status: StatusSink | None = None,
                 options: RunOptions | None = None, on_data: DataSink | None = None,
                 restarts: Restarts | None = None,
                 ended_by: Callable[[], str | None] | None = None,
                 console_dropped: Callable[[], int] | None = None,
                 environment: dict[str, Any] | None = None,
                 reship: Reship | None = None) -> None:
        self.plan = self._first = plan
        self.restarts = restarts
        self.ended_by = ended_by
        """After a failed attempt: who ended it from outside, if anyone did (Slurm's scancel,
        time limit, preemption): then it is not the job's failure, and never restarted."""
        self.console_dropped = console_dropped
        """How many of the lines given to ``on_line`` its console skipped (for the summary)."""
        self.environment = environment
        """``summary.json``'s ``environment`` (``venvs.runenv``), None without one."""
        self.reship = reship
        """Where the first attempt launched without asking whether the nodes have the project's
        environment: what ships it when a guard says they do not (once)."""
        self.run_dir = run_dir
        self.layout = RunDir(run_dir)
        self.opts = options or RunOptions()
        self.notes = Notes(on_status or (lambda text: None))
        sinks = Sinks.given(on_line, self.notes, on_data)
        self.stops = Stops()
        events: queue.Queue[tuple[int, str, Any]] = queue.Queue()
        self.door = HeadDoor(plan.job_id, lambda ask: events.put((ANY_ATTEMPT, "", ask)),
                             self.request_stop)
        self.ctx = RunContext(opts=self.opts, transports=transports, run_dir=run_dir,
                              events=events, logs=RunLogs(run_dir, on_error=self.notes),
                              stacks=StackCollector(run_dir, self.notes), sinks=sinks,
                              stops=self.stops, door=self.door,
                              on_ranks_started=self.notes.release)
        self.logs, self.events = self.ctx.logs, self.ctx.events
        self.attempt: Attempt | None = None
        """The attempt that runs (or ran last)."""
        self.went_cold: list[Failure] = []
        """The failures for which an attempt was launched again all cold (summary's
        ``went_cold``)."""
        self.waited: list[list[Failure]] = []
        """``--wait``: the refusals waited out, one list each time the note said them
        (summary's ``waited``)."""
        self._away: dict[str, NodeOutcome] = {}
        """The nodes dropped after an attempt because they were lost (``restart.GONE``, cut
        off), each with its outcome there (its guard's pid, its boot): asked at a later
        restart whether they answer again."""
        self._addresses: dict[str, str] = {}
        """Each node's address as its guard last reported it (where a new master is reached)."""

    @property
    def sup(self) -> Supervisor | None:
        """The supervisor of the attempt that runs (or ran last)."""
        return None if self.attempt is None else self.attempt.sup

    def request_stop(self, reason: str = "interrupted", signum: int | None = None) -> None:
        """Thread- and signal-safe: ask the run to end everywhere (Ctrl-C, SIGTERM: the
        signal's number, for the result's outcome)."""
        self.stops.request(reason, signum)

    def new_attempt(self) -> Attempt:
        """An attempt of the current plan (the next to run)."""
        self.attempt = Attempt(self.plan, self.ctx)
        return self.attempt

    def run(self) -> RunResult:
        """Every attempt of the job (one unless ``restarts`` allows more): the last one's
        result, with the record of each attempt."""
        t0 = time.monotonic()
        self.logs.max_open = log_files_budget(len(self.plan.nodes))
        self.layout.create(self.plan.attempt, plan_json(self.plan, self.opts))
        attempts: list[AttemptRecord] = []
        control = self._open_control()  # one for the job: `stacks` reaches the running attempt
        try:
            result = self._attempts(attempts, t0)
        finally:
            if control is not None:
                control.close()
        self.logs.close()  # (every line written before the summary counts what is missing)
        if self.console_dropped is not None:  # (no line reaches on_line after the loop)
            result.console_dropped = self.console_dropped()
        result.log_errors = [f"{error} ({self.logs.lost.get(name, 0)} line(s) missing)"
                             for name, error in self.logs.errors.items()]
        result.environment = self.environment
        result.went_cold, result.waited = self.went_cold, self.waited
        result.signum = self.stops.signum
        self.layout.write_summary(result.to_json())
        return result

    def _attempts(self, attempts: list[AttemptRecord], t0: float) -> RunResult:
        waiting_since, said = time.monotonic(), ""
        while True:
            if self.opts.wait is not None or self.reship is not None:  # (notes: if not again)
                self.notes.hold()
            watch = self._watch_returns(attempts)
            try:
                view, result, record = self.new_attempt().run(attempts, t0)
            except BaseException:
                self.notes.drop()
                raise
            finally:
                if watch is not None:
                    watch.stop()
            if self._may_reship(result):
                self.notes.drop()
                self._reship(result)
                continue
            if self._may_go_cold(result, record):
                self.notes.release()
                self.notes(f"{', '.join(sorted({f.host for f in result.failures}))}: its warm "
                           "pool failed at the fork after the other nodes' had forked: "
                           "launching again with every node's ranks cold (not counted as a "
                           "restart)")
                self.opts = self.ctx.opts = replace(self.opts, pooled=False)
                self.went_cold = list(result.failures)
                continue
            if self._may_wait(result, time.monotonic() - waiting_since):
                self.notes.drop()
                said = self._wait(result, said)
                if not self.stops.count:
                    continue
            self.notes.release()
            attempts.append(record)
            result.attempts = attempts
            if not self._restart(attempts, view, result, record):
                return result

    def _may_wait(self, result: RunResult, waited: float) -> bool:
        """``--wait``: the attempt was refused only because other jobs hold what it asks for,
        no rank started, and the wait is not over."""
        return (self.opts.wait is not None and waited < self.opts.wait
                and not self.stops.count and bool(result.failures)
                and all(f.kind is FailureKind.BUSY for f in result.failures)
                and all(r.started_at is None for r in result.ranks))

    def _may_reship(self, result: RunResult) -> bool:
        """The attempt was refused only because the project's environment the head expected
        is missing or changed on some nodes (their guards said so), no rank started, and it was
        not shipped yet."""
        return (self.reship is not None and not self.stops.count and bool(result.failures)
                and all(f.kind is FailureKind.ENVIRONMENT for f in result.failures)
                and all(r.started_at is None for r in result.ranks))

    def _may_go_cold(self, result: RunResult, record: AttemptRecord) -> bool:
        """The attempt failed only because a node's warm pool could not fork its ranks after
        the others' had (``guard.pool-lost``: pooled and cold ranks never meet, so no rank
        got past its rendezvous; nothing saved), and its ranks still may come from pools."""
        return (self.opts.pooled and not self.stops.count and bool(result.failures)
                and all(f.code == POOL_LOST.code for f in result.failures)
                and record.checkpoint is None)

    def _reship(self, result: RunResult) -> None:
        """Ship and build the environment (``Reship``), then the same job on its plan;
        ``summary.json``'s ``environment.reshipped``: each node's guard's refusal that made it
        (its code)."""
        assert self.reship is not None
        hosts = sorted({f.host for f in result.failures})
        self.notes(f"the project's environment is not ready on {', '.join(hosts)}: "
                   "shipping it, then launching again")
        got, self.reship = self.reship(self.plan), None
        self.plan = self._first = got.plan
        self.environment = {**got.environment,
                            "reshipped": {f.host: f.code for f in result.failures}}
        if self.restarts is not None:
            self.restarts = replace(self.restarts, spec=got.spec)
        self.layout.write_plan(self.plan.attempt, plan_json(self.plan, self.opts))

    def _wait(self, result: RunResult, said: str) -> str:
        """Say who holds what the job asks for (once, and again when that changes), wait a
        poll's time (or until a stop is asked for); what was said."""
        why = "; ".join(f"{f.host}: {f.message}" for f in result.failures)
        if why != said:
            self.notes(f"waiting (--wait, no queue): {why}")
            self.waited.append(list(result.failures))
        deadline = time.monotonic() + self.opts.wait_poll
        while time.monotonic() < deadline and not self.stops.count:
            time.sleep(0.1)
        return why

    def _restart(self, attempts: list[AttemptRecord], view: Supervisor, result: RunResult,
                 record: AttemptRecord) -> bool:
        """After an attempt: who ended it, and whether another follows (``restart.decide``);
        if one does, its plan is made, announced and written: True."""
        self._addresses.update((n.host, str(n.facts["address"])) for n in result.nodes
                               if n.facts.get("address"))
        killed_by = self.door.killed_by or view.killed_by  # (through the head, or a guard)
        if not record.ok and killed_by:
            result.ended_by = killed_by
        elif not record.ok and self.ended_by is not None:
            result.ended_by = self.ended_by() or ""
        record.end = result.outcome.value
        back = list(view.readmit) if record.planned is not None else \
            self._answering_again(attempts, result)
        file_nodes = () if self.restarts is None else self.restarts.spec.nodes
        ours = {n.host for n in file_nodes}
        decision = decide(None if self.restarts is None else self.restarts.policy,
                          attempts, result.failures, result.interrupted, view.cut_off,
                          ended_by=result.ended_by, stop_requested=self.stops.count > 0,
                          spares=self._spares_left(attempts) + tuple(
                              h for h in back if h not in ours),  # (a spare back: a spare)
                          returned=[h for h in back if h in ours], size=len(file_nodes))
        record.dropped, record.dropped_why = list(decision.drop), dict(decision.why)
        record.replaced, record.readmitted = dict(decision.replace), list(decision.readmit)
        gone = {f.host for f in result.failures if f.kind in GONE} | set(view.cut_off)
        self._away.update((n.host, n) for n in result.nodes
                          if n.host in decision.drop and n.host in gone)
        result.interrupted = result.interrupted or decision.stopped
        if not decision.restart or self.restarts is None:
            result.gave_up, result.no_progress = decision.reason, decision.no_progress
            result.gave_up_problem = decision.gave_up
            self._end_kept_pools(record, gone, result.nodes)
            return False
        for host in (*decision.readmit, *(spare for _, spare in decision.replace)):
            self._away.pop(host, None)
        hosts = _next_hosts(self.plan, file_nodes, decision)
        if set(record.hosts) - set(hosts) - gone:  # (dropped, yet answering: its pool is no
            self._end_kept_pools(record, gone | set(hosts), result.nodes)  # next guard's)
        before = self.plan
        self.plan = self.restarts.next_plan(self._first, len(attempts), hosts, self._addresses)
        self.notes(f"{decision.reason}: attempt {len(attempts)} on {len(hosts)} node(s), world "
                   f"size {self.plan.world_size}{_size_change(before, self.plan, decision)}, "
                   f"rendezvous port {self.plan.master_port or 'auto'}")
        self.layout.write_plan(self.plan.attempt, plan_json(self.plan, self.opts))
        return True

    def _end_kept_pools(self, record: AttemptRecord, skip: set[str],
                        nodes: list[NodeOutcome]) -> None:
        """The job's warm pools that the guards of a failed attempt kept for a restart the
        runner then decided against (no progress, ended from outside, too few nodes, the
        user's stop that came after the attempt had ended: ``--wait``'s poll, between
        attempts), or on a node the next attempt leaves out (dropped, or its place taken by a
        spare): ended now (``node.warm.pools``), not left waiting ``wire.JOB_POOL_WITHIN``
        for a guard. Asked where the guard's exit frame said it kept one, or no exit frame
        came; not on the nodes ``skip`` (gone, or going on)."""
        left = int(dict(self.plan.nodes[0].env).get(MAX_RESTARTS_VAR, 0)) > self.plan.attempt
        if record.ok or not left:
            return  # (none kept: no restart was left)
        kept_none = {n.host for n in nodes if n.kept_pool is False}
        stop: PoolsConfig = {"stop": True, "job": self.plan.job_id}
        members = [Member(n.host, self.ctx.transports[n.host], n.python, stop)
                   for n in self.plan.nodes
                   if n.host in record.hosts and n.host not in skip | kept_none
                   and "job" in (n.warm_config(self.plan, self.opts) or {})]
        if members:
            ask_all(members, WARM, Kind.RESULT, KEPT_POOLS_WAIT)

    def _answering_again(self, attempts: list[AttemptRecord], result: RunResult) -> list[str]:
        """The nodes (and spares) dropped after earlier attempts that answer again now, their
        guard of then gone (``lost.answering_again``): only after a failure that may be
        restarted (a restart left), and only when some are away."""
        record = attempts[-1]
        if self.restarts is None or record.ok or result.interrupted or result.ended_by or \
                self.stops.count or not self._away or \
                restarts_used(attempts) >= self.restarts.policy.max_restarts:
            return []
        python = {n.host: n.python for n in self.restarts.spec.machines}
        away = [n for h, n in self._away.items() if h not in record.hosts and h in python]
        return answering_again(away, python, self.plan.job_id, self.ctx.transports)

    def _watch_returns(self, attempts: list[AttemptRecord]) -> ReturnWatch | None:
        """``run --readmit``: while the next attempt runs, look for the nodes of the cluster
        file lost earlier (``launch.readmit_watch``); None when there is nothing to watch."""
        if not self.opts.readmit or self.restarts is None:
            return None
        python = {n.host: n.python for n in self.restarts.spec.nodes}
        away = [n for h, n in self._away.items() if h in python and h not in
                {p.host for p in self.plan.nodes}]
        if not away:
            return None
        first = {p.host: p for p in self._first.nodes}
        saved = {h: p for a in attempts for h, p in a.checkpoint_paths.items()}
        strikes = Counter(a.cause.host for a in attempts if a.cause is not None)
        attempt, put = self.plan.attempt, self.events.put
        watched = Watched(
            away=away, python=python, job_id=self.plan.job_id, transports=self.ctx.transports,
            health={n.host: health_context(first[n.host], saved.get(n.host))
                    for n in away if n.host in first},
            twice=frozenset(h for h in python if strikes[h] >= 2),
            room=max(0, len(python) - len(self.plan.nodes)))
        return ReturnWatch(watched, lambda back: put((attempt, back.host, back))).start()

    def _spares_left(self, attempts: list[AttemptRecord]) -> tuple[str, ...]:
        """The cluster file's spares that no attempt ran on yet, in file order."""
        if self.restarts is None:
            return ()
        ran = {h for a in attempts for h in a.hosts}
        return tuple(s.host for s in self.restarts.spec.spares if s.host not in ran)

    # -- the control socket -------------------------------------------------------------------
    def _open_control(self) -> ControlServer | None:
        """``ptcluster stacks`` asks through this; a run goes on without it."""
        try:
            control = ControlServer(self.run_dir, self.door.answer, job_id=self.plan.job_id)
        except OSError as exc:
            self.notes(f"no control socket in {self.run_dir} ({exc}): `ptcluster stacks` "
                       "cannot reach this job")
            return None
        if control.unregistered:
            self.notes(f"this job is not in your registry of heads ({control.unregistered})"
                       ": `ptcluster kill` on this machine goes through its nodes' guards")
        return control

