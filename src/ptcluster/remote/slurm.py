"""How the head reaches a node of a Slurm allocation: one ``srun`` step per node; and what the
head asks Slurm at run time (``scontrol``: the allocation's nodes, whether Slurm ended the job).

The same node program, channel, heartbeats and teardown as over ssh; only the process that
carries the channel differs. Each node gets its own step (``-N1 -n1 --nodelist NODE``): one
task, the guard, with the channel on its stdin/stdout; the guard starts torchrun and the ranks
as its children, inside the step, so Slurm accounts for them and ``scancel`` reaches them.

- ``--overlap``: the step shares the allocation's CPUs and GPUs with any other step (the
  batch script's, a second ``ptcluster`` command), instead of waiting for them to be free.
- No ``--gpus-per-task`` / ``--gres``: a step gets every GPU the job has on the node, so the
  ranks see their peers' GPUs (``--gpus-per-task`` hides them from NCCL's peer-to-peer paths).
- No ``--exact`` and no ``--cpus-per-task``: the one task's step holds every CPU the job has on
  the node, so no binding plugin ties all of a node's ranks to one CPU (``doctor`` checks what
  each rank may use).
- ``--kill-on-bad-exit=1``: should the guard itself die, Slurm ends the step at once.
- ``--export`` names what the node program gets of the head's environment: the basics a login
  shell would have (as over ssh) plus Slurm's own ``SLURM_*``; nothing else is shipped.
- The per-task inputs a job's environment sets for its *own* steps (``SLURM_NTASKS``,
  ``SLURM_GPUS_PER_TASK``, …) are removed from srun's environment: they would contradict
  ``-n1`` or hide GPUs.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from ptcluster.cluster.slurm import Runner, SlurmError
from ptcluster.node.problems import Declared
from ptcluster.remote.transport import Transport

NO_SCONTROL = Declared(
    "slurm.no-scontrol", "in an allocation without Slurm's clients",
    "SLURM_JOB_ID is set but scontrol is not installed here",
    "run ptcluster on a node with the Slurm clients, or pass --cluster")
TABLE = (NO_SCONTROL,)
"""What asking Slurm about the allocation refuses (``slurm.*`` codes)."""

EXPORTED = ("HOME", "PATH", "USER", "LOGNAME", "LANG", "LC_ALL", "SHELL", "TMPDIR")
"""What the node program gets of the head's environment (plus Slurm's ``SLURM_*``)."""
STEP_INPUTS = (
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS_PER_SOCKET",
    "SLURM_NTASKS_PER_CORE", "SLURM_NTASKS_PER_GPU", "SLURM_CPUS_PER_TASK",
    "SRUN_CPUS_PER_TASK", "SLURM_GPUS_PER_TASK", "SLURM_TRES_PER_TASK", "SLURM_DISTRIBUTION",
    "SLURM_CPU_BIND", "SLURM_EXACT", "SLURM_MEM_BIND",
)
"""srun reads these as options: the job's own values must not reach our one-task steps."""


@dataclass
class SrunTransport(Transport):
    """A node of Slurm job ``job_id``: ``host`` is its NodeAddr, ``node`` its NodeName."""

    host: str
    node: str
    job_id: str
    srun: str = "srun"

    def argv(self, node_argv: list[str]) -> list[str]:
        exported = ",".join(k for k in EXPORTED if k in os.environ) or "NONE"
        return [self.srun, f"--jobid={self.job_id}", "--overlap", "--nodes=1", "--ntasks=1",
                f"--nodelist={self.node}", "--kill-on-bad-exit=1",
                f"--export={exported}", "--job-name=ptcluster", "--quiet", "--",
                os.path.expanduser(node_argv[0]), *node_argv[1:]]

    def spawn(self, node_argv: list[str]) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k not in STEP_INPUTS}
        return subprocess.Popen(
            self.argv(node_argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, env=env,
        )


def run_scontrol(argv: list[str], timeout: float = 30.0) -> str:
    """The default :data:`Runner`: ``scontrol ARGS`` (``SLURM_CONF`` as the caller has it)."""
    try:
        proc = subprocess.run(["scontrol", *argv], capture_output=True, text=True,
                              timeout=timeout)
    except FileNotFoundError:
        raise SlurmError.of(NO_SCONTROL) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"scontrol {' '.join(argv)} did not answer in {timeout:.0f} s",
                         "check that slurmctld is up (scontrol ping)") from None
    if proc.returncode != 0:
        detail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise SlurmError(f"scontrol {' '.join(argv)} failed: {detail[0]}",
                         "check the job still runs (squeue -j $SLURM_JOB_ID), or pass --cluster")
    return proc.stdout


def ended_by_slurm(job_id: str, scontrol: Runner | None = None) -> str | None:
    """Why the job's processes were signalled, when it was Slurm that ended them (``scancel``,
    the time limit, preemption, a requeue): the job is no longer RUNNING. None while it runs,
    or when Slurm cannot tell within 5 s (a job at its time limit has KillWait, 30 s by
    default, before Slurm kills the head: the summary must still be written)."""
    try:
        text = (scontrol or (lambda argv: run_scontrol(argv, timeout=5.0)))(
            ["-o", "show", "job", job_id])
    except SlurmError:
        return None
    ended = job_end(text)
    if ended is None:
        return None
    state, reason = ended
    why = f", reason {reason}" if reason else ""
    return (f"Slurm ended job {job_id} (JobState={state}{why}): the ranks were stopped by "
            "Slurm (scancel, time limit, preemption or requeue), not by a failure of the job")


def job_end(text: str) -> tuple[str, str | None] | None:
    """(JobState, Reason; None for none) of a job that no longer runs, from ``scontrol -o show
    job``; None while it runs (or when the answer has no state)."""
    m = re.search(r"(?:^|\s)JobState=(\S+)", text)
    if m is None or m.group(1) == "RUNNING":
        return None
    reason = re.search(r"(?:^|\s)Reason=(\S+)", text)
    return m.group(1), (reason.group(1) if reason and reason.group(1) != "None" else None)
