"""The exit codes of every ``ptcluster`` command, with what each means: one table, which the
commands return from and the docs' reference is generated from."""

from __future__ import annotations

import signal

from ptcluster.launch.result import Outcome

OK = 0
FAILED = 1
USAGE = 2
NO_PROGRESS = 3
HUNG = 4
INTERRUPTED = 128 + signal.SIGINT
TERMINATED = 128 + signal.SIGTERM

EXIT_CODES: tuple[tuple[int, str], ...] = (
    (OK, "Success: for `run`, every rank of the job exited 0; for `doctor`, no check failed "
         "(warnings allowed); for `setup`, every node converged."),
    (FAILED, "A failure: a rank failed or a node was lost (`run`), a check failed (`doctor`, "
             "`run --preflight`), a node did not converge or a change is pending "
             "(`setup`, `setup --check`), or any other error a user can cause that is not "
             "bad usage, always with one `error: … Fix: …` line."),
    (USAGE, "Bad usage: an unknown option, a bad option value, or a bad cluster file (the line "
            "names the file, the key and the fix)."),
    (NO_PROGRESS, "`run --max-restarts`: the restarts gave up because an attempt saved no "
                  "checkpoint newer than the step it started from (it would only fail the "
                  "same way again)."),
    (HUNG, "`run --hang-timeout`: no rank made progress for that long; every rank's stack is "
           "in `hang-stacks.txt`, the straggler first."),
    (INTERRUPTED, "Ctrl-C (SIGINT): the job was torn down on every node (128 + the signal)."),
    (TERMINATED, "SIGTERM, `ptcluster kill`, or Slurm ended the job (scancel, the time limit, "
                 "preemption; `summary.json` says who in `ended_by`): torn down, never "
                 "restarted."),
)

BY_OUTCOME: dict[Outcome, int] = {
    Outcome.SUCCEEDED: OK, Outcome.FAILED: FAILED, Outcome.HUNG: HUNG,
    Outcome.NO_PROGRESS: NO_PROGRESS, Outcome.INTERRUPTED: INTERRUPTED,
    Outcome.ENDED_OUTSIDE: TERMINATED, Outcome.PLANNED_RESTART: FAILED}
"""``run``'s exit code for each outcome (interrupted: 128 + the signal, where one came). A
planned restart (``run --readmit``) ends an attempt, never a run: the attempt that takes the
node back always follows; were it missing, the job did not finish (1)."""


def for_outcome(outcome: Outcome, signum: int | None = None) -> int:
    """``run``'s exit code: ``BY_OUTCOME``'s, and 128 + the signal for one that stopped it."""
    if outcome is Outcome.INTERRUPTED and signum:
        return 128 + signum
    return BY_OUTCOME[outcome]
