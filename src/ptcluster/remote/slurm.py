"""How the head reaches a node of a Slurm allocation: one ``srun`` step per node.

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
import subprocess
from dataclasses import dataclass

from ptcluster.remote.transport import Transport

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
