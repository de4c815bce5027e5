"""How a run ended, one word (``RunResult.outcome``), and the exit code that follows from it by
one table (``cli.exits.for_outcome``): every case of the old if-chain, and summary.json."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from ptcluster.cli import exits
from ptcluster.launch.result import Failure, FailureKind, Outcome, RankRecord, RunResult

RANK_FAILED = Failure(host="n1", rank=1, message="exited 1", exit_code=1)
HANG = Failure(host="n1", rank=None, message="no progress", kind=FailureKind.HANG)


def result(*, code: int = 0, failures: tuple[Failure, ...] = (), interrupted: bool = False,
           no_progress: bool = False, ended_by: str = "", signum: int | None = None) -> RunResult:
    return RunResult(job_id="J", run_dir=Path("r"), nodes=[], failures=list(failures),
                     ranks=[RankRecord(rank=0, host="n0", local_rank=0, exit_code=code)],
                     interrupted=interrupted, duration=1.0, no_progress=no_progress,
                     ended_by=ended_by, signum=signum)


@pytest.mark.parametrize(("run", "outcome", "code"), [
    (result(), Outcome.SUCCEEDED, 0),
    (result(code=1, failures=(RANK_FAILED,)), Outcome.FAILED, 1),
    (result(code=-9, failures=(HANG,)), Outcome.HUNG, 4),
    (result(code=1, failures=(RANK_FAILED,), no_progress=True), Outcome.NO_PROGRESS, 3),
    # Ctrl-C: what the teardown made the ranks do is not the cause
    (result(code=-15, failures=(RANK_FAILED,), interrupted=True, signum=signal.SIGINT),
     Outcome.INTERRUPTED, 130),
    (result(code=-15, interrupted=True, signum=signal.SIGTERM), Outcome.INTERRUPTED, 143),
    # ptcluster kill (no signal to this head): interrupted, 130
    (result(code=-15, interrupted=True), Outcome.INTERRUPTED, 130),
    # a rank failed before the kill arrived: the failure stands
    (result(code=1, failures=(RANK_FAILED,), interrupted=True), Outcome.FAILED, 1),
    # Slurm ended it, whatever the ranks did on the way down
    (result(code=-15, failures=(RANK_FAILED,), interrupted=True, ended_by="scancel"),
     Outcome.ENDED_OUTSIDE, 143),
    # ... unless the head got a signal itself
    (result(code=-15, interrupted=True, ended_by="scancel", signum=signal.SIGINT),
     Outcome.INTERRUPTED, 130),
])
def test_the_outcome_and_its_exit_code(run: RunResult, outcome: Outcome, code: int) -> None:
    assert run.outcome is outcome
    assert exits.for_outcome(run.outcome, run.signum) == code
    said = json.loads(json.dumps(run.to_json()))
    assert said["outcome"] == outcome.value
    assert said["signal"] == (None if run.signum is None else signal.Signals(run.signum).name)


def test_every_outcome_has_an_exit_code_of_the_table() -> None:
    table = {code for code, _ in exits.EXIT_CODES}
    assert set(exits.BY_OUTCOME) == set(Outcome)
    assert set(exits.BY_OUTCOME.values()) <= table
