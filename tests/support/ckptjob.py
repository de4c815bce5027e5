"""Run ``tests/programs/ckpt_job.py`` as a real multi-process gloo job on this machine, its
"nodes" given separate disks: every node's ranks get ``PTCLUSTER_CKPT_ROOT=BASE/node<N>`` and
torchrun's node variables (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), so nothing of
one node's checkpoint is on another's root by accident. Each rank is its own process group,
killed by that group (never by name) when the test ends, failed or not."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ptcluster.node.rank_wire import CKPT_ROOT_VAR

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "tests" / "programs" / "ckpt_job.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def wait(self, timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()

    def output(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(errors="replace")


def start(base: Path, nodes: int, per_node: int, *args: str) -> Job:
    port, job = free_port(), Job()
    base.mkdir(parents=True, exist_ok=True)
    for n in range(nodes):
        for local in range(per_node):
            rank = n * per_node + local
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nodes * per_node),
                       LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_node),
                       GROUP_RANK=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", **{CKPT_ROOT_VAR: str(base / f"node{n}")})
            env.pop("PTCLUSTER_GUARD_SOCK", None)
            log = base / f"rank{rank}.log"
            with open(log, "wb") as out:
                job.procs.append(subprocess.Popen(
                    [sys.executable, str(PROGRAM), *args], env=env, stdout=out,
                    stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True))
            job.logs.append(log)
    return job


def run(base: Path, nodes: int, per_node: int, *args: str, timeout: float = 240) -> Job:
    """Start the job and wait for it; every rank must exit 0."""
    job = start(base, nodes, per_node, *args)
    try:
        codes = job.wait(timeout)
    finally:
        job.kill()
    assert codes == [0] * len(codes), "\n".join(
        f"rank {r} exit {c}:\n{job.output(r)[-3000:]}" for r, c in enumerate(codes) if c)
    return job
