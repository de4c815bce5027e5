"""``ptcluster submit``: a readable sbatch script whose body is ``ptcluster run``.

The script asks Slurm for whole nodes' worth of what the job needs with *one task per node*:
the tasks are not the ranks. Inside the allocation ``ptcluster run`` takes the nodes from Slurm
and starts one ``srun`` step per node itself (``remote/slurm.py``), so the job gets ptcluster's
prefixed logs, root cause and teardown, and Slurm still starts and ends every process.

- ``--signal=USR2@120``: every rank gets SIGUSR2 two minutes before Slurm ends the job (time
  limit or preemption); the reference trainer checkpoints and requeues on it.
- ``--requeue`` and ``--open-mode=append``: a requeued run appends to the same log.
- Everything lands in one run directory: the script, Slurm's log, and ``ptcluster run``'s own
  run directories (one per run of the job).
"""

from __future__ import annotations

import re
import secrets
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ptcluster.errors import PtclusterError, UsageError
from ptcluster.node.problems import Declared
from ptcluster.rundir import RunDirError, make_private, write_private

SCRIPT_FILE = "job.sbatch"
SLURM_LOG_FILE = "slurm-%j.out"
"""Slurm's own log of the job (``%j``: its job id)."""
JOB_ID_FILE = "job_id"
"""The Slurm job id, written by ``ptcluster submit`` once it is known.

These three are a submit directory's own files, beside the run directories its ``ptcluster run``
makes in it (``ptcluster.rundir.RunDir``)."""
SIGNAL_LEAD = 120
"""Seconds of warning before the end: ``--signal=USR2@SIGNAL_LEAD``."""
_TIME = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2}")
_WORD = re.compile(r"[A-Za-z0-9_.,+-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""A line break ends a ``#SBATCH`` line (and makes the rest a line of the script) whatever the
quoting: no control character goes into the script at all."""

NOT_A_TIME = Declared(
    "submit.not-a-time", "--time is not a Slurm time", "--time {time} is not a Slurm time",
    "use MM, HH:MM:SS or D-HH:MM, e.g. --time 2:00:00")
CONTROL_CHARACTER = Declared(
    "submit.control-character", "a value of the batch script holds a control character",
    "{what} {value} holds a control character (a line break ends a line of the batch script)",
    "use names without line breaks or control characters (rename the folder and cd into it, "
    "or pass --run-dir elsewhere)")
TABLE = (NOT_A_TIME, CONTROL_CHARACTER)
"""What ``submit`` refuses (``submit.*`` codes) before it writes a script."""


@dataclass(frozen=True, kw_only=True)
class SubmitConfig:
    """What ``ptcluster submit`` asks Slurm for, and what it runs."""

    run_args: tuple[str, ...]
    """The arguments of ``ptcluster run`` (``-m MODULE …`` or ``SCRIPT …``)."""
    run_dir: Path
    """Folder for the script, Slurm's log and the runs' logs (absolute: the job may start
    anywhere)."""
    workdir: Path
    """The job's working directory (``--chdir``)."""
    nodes: int = 1
    """``--nodes``."""
    gpus_per_node: int | None = None
    """``--gpus-per-node``; the ranks per node follow it (one per GPU)."""
    nproc: int | None = None
    """Ranks per node when not one per GPU (passed to ``ptcluster run --nproc``)."""
    time_limit: str | None = None
    """``--time`` in Slurm's forms: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``."""
    partition: str | None = None
    """``--partition``."""
    job_name: str = "ptcluster"
    """``--job-name``."""
    python: str = field(default_factory=lambda: sys.executable)
    """Interpreter that runs ``ptcluster`` in the batch script (this one, by default)."""

    def __post_init__(self) -> None:
        if not self.run_args:
            raise UsageError("nothing to run", "give a SCRIPT or -m MODULE after --, e.g. "
                             "ptcluster submit --nodes 2 -- -m ptcluster.examples.mnist")
        if self.nodes < 1:
            raise UsageError("--nodes must be >= 1", "pass --nodes 1 or more")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise UsageError("--gpus-per-node must be >= 0", "pass --gpus-per-node 0 or more")
        if self.nproc is not None and self.nproc < 1:
            raise UsageError("--nproc must be >= 1", "pass --nproc 1 or more")
        if self.time_limit is not None and not _TIME.fullmatch(self.time_limit):
            raise UsageError.of(NOT_A_TIME, time=repr(self.time_limit))
        for name, value in (("--partition", self.partition), ("--job-name", self.job_name)):
            if value is not None and not _WORD.fullmatch(value):
                raise UsageError(f"{name} {value!r} has characters Slurm does not take",
                                 f"use letters, digits and _.,+- in {name}")
        if not self.run_dir.is_absolute() or not self.workdir.is_absolute():
            raise ValueError("run_dir and workdir are absolute")
        _refuse_control([("the working directory", str(self.workdir)),
                         ("--run-dir", str(self.run_dir)), ("the interpreter", self.python),
                         *(("an argument", arg) for arg in self.run_args)])


def _refuse_control(values: list[tuple[str, str]]) -> None:
    """Every value the batch script holds is one shell word or one ``#SBATCH`` line: a control
    character (a line break above all) would start a line of its own, run as the user."""
    for what, value in values:
        if _CONTROL.search(value):
            raise UsageError.of(CONTROL_CHARACTER, what=what, value=repr(value))


def new_run_dir(base: Path) -> Path:
    """``BASE/submit-YYYYmmdd-HHMMSS-xxxx`` (absolute)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return (base / f"submit-{stamp}-{secrets.token_hex(2)}").absolute()


def render_script(cfg: SubmitConfig) -> str:
    """The batch script: ``#SBATCH`` lines, each with why, then ``exec ptcluster run``."""
    opts: list[tuple[str, str | None, str]] = [
        ("job-name", cfg.job_name, ""),
        ("nodes", str(cfg.nodes), ""),
        ("ntasks-per-node", "1", "one task per node: ptcluster starts the ranks itself")]
    if cfg.gpus_per_node:
        opts.append(("gpus-per-node", str(cfg.gpus_per_node), "one rank per GPU"))
    if cfg.time_limit:
        opts.append(("time", cfg.time_limit, ""))
    if cfg.partition:
        opts.append(("partition", cfg.partition, ""))
    opts += [
        ("chdir", str(cfg.workdir), ""),
        ("output", str(cfg.run_dir / SLURM_LOG_FILE), "Slurm's log of the job, in the run dir"),
        ("open-mode", "append", "a requeued run appends to the same log"),
        ("signal", f"USR2@{SIGNAL_LEAD}",
         f"every rank gets SIGUSR2 {SIGNAL_LEAD} s before the end: time to checkpoint"),
        ("requeue", None, "preempted or requeued, the job runs again and resumes"),
    ]
    lines = ["#!/bin/bash",
             "# Written by `ptcluster submit`. The body is `ptcluster run`: inside the allocation",
             "# it takes the nodes from Slurm and starts one `srun` step per node."]
    for key, value, why in opts:
        if why:
            lines.append(f"# {why}")
        lines.append(f"#SBATCH {_sbatch_opt(key, value)}")
    lines.append("")
    run = [cfg.python, "-m", "ptcluster", "run", "--run-dir", str(cfg.run_dir)]
    if cfg.nproc is not None:
        run += ["--nproc", str(cfg.nproc)]
    lines += ['echo "ptcluster submit: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) '
              'on $SLURM_JOB_NODELIST"',
              "exec " + shlex.join([*run, *cfg.run_args]), ""]
    return "\n".join(lines)


def _sbatch_opt(key: str, value: str | None) -> str:
    return f"--{key}" if value is None else f"--{key}={shlex.quote(value)}"


def write_script(cfg: SubmitConfig) -> Path:
    """The submit directory, new and ours alone (0700) in a parent of ours no one else can
    change (as a run directory: ``ptcluster.rundir``), with the script in it (sbatch reads it)."""
    path = cfg.run_dir / SCRIPT_FILE
    try:
        make_private(cfg.run_dir)
        write_private(path, render_script(cfg))
    except OSError as exc:
        raise RunDirError(f"cannot write the submit directory {cfg.run_dir}: "
                          f"{exc.strerror or exc}", "pass --run-dir with a directory of yours "
                          "that others cannot write") from None
    return path


def submit(script: Path) -> str:
    """``sbatch --parsable SCRIPT``; the job id."""
    try:
        proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                              text=True, timeout=60)
    except FileNotFoundError:
        raise PtclusterError("sbatch is not installed here",
                             "run ptcluster submit on a Slurm login node") from None
    except subprocess.TimeoutExpired:
        raise PtclusterError("sbatch did not answer in 60 s",
                             "check that slurmctld is up (scontrol ping)") from None
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise PtclusterError(f"sbatch refused {script}: {detail}",
                             "fix the option Slurm names, or run the script by hand: "
                             f"sbatch {script}")
    job = proc.stdout.strip().split(";")[0]  # --parsable: "JOBID" or "JOBID;CLUSTER"
    if not job:
        raise PtclusterError("sbatch printed no job id", f"check squeue; the script is {script}")
    return job
