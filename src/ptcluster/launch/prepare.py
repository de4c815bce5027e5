"""Preparing a job: what ``ptcluster run``, doctor and bench put together before a Runner starts:
the port, the plan, how restarts are planned, the run dir; and a
shipped rank program run through the same launcher."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

from ptcluster.cluster.model import ClusterSpec
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import AUTO_PORT, LaunchPlan, Target, new_job_id, plan_launch
from ptcluster.launch.result import RunResult
from ptcluster.launch.runner import DataSink, LineSink, Restarts, Runner
from ptcluster.launch.supervise.restart import RestartPolicy
from ptcluster.node import Program
from ptcluster.remote.bootstrap import pack_source
from ptcluster.remote.connect import outside_stop, transports

DEFAULT_RUNS_DIR = "ptcluster-runs"


def free_port() -> int:
    """A TCP port free on loopback now (the local cluster's rendezvous, like --standalone)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_port(spec: ClusterSpec, override: int | None) -> int:
    """The rendezvous port: ``--port``, else ``master.port``; ``auto`` is a free port on the
    local cluster (the head is its master) and else :data:`AUTO_PORT`, for the master node's
    guard to choose at launch."""
    if override is not None:
        return override
    if spec.master.port is not None:
        return spec.master.port
    return free_port() if spec.local else AUTO_PORT


def local_gpu_count() -> int:
    """GPUs on this machine, without importing torch (nvidia-smi -L); 0 when none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def prepare(spec: ClusterSpec, target: Target, port: int | None = None,
            job_id: str | None = None, max_restarts: int = 0) -> LaunchPlan:
    return plan_launch(spec, target, port=resolve_port(spec, port), job_id=job_id or new_job_id(),
                       max_restarts=max_restarts)


def restarts(spec: ClusterSpec, target: Target, first: LaunchPlan,
             policy: RestartPolicy) -> Restarts:
    """How the attempts after ``first`` are planned: the same job over the nodes that remain
    (ranks renumbered in file order), a fresh rendezvous port (a fresh store, so no key of the
    failed attempt is seen again: pytorch#135712), and node rank 0 hosting it — when the master's
    node was dropped, the next node in the file takes over, at its ``host``; or, when the
    cluster file gave the master an address of its own (a fabric address, while ``host`` is how
    the head reaches it), at the address that node's guard reported on its interface (the one
    it chose to reach the old master: the same network), or at its host when it reported none
    (an interface list or prefix in the cluster file names no one address)."""

    def replan(attempt: int, hosts: tuple[str, ...], addresses: dict[str, str]) -> LaunchPlan:
        nodes = tuple(n for n in spec.nodes if n.host in hosts)
        master = spec.master
        if nodes[0].host != spec.nodes[0].host:
            own = spec.master.addr != spec.nodes[0].host and addresses.get(nodes[0].host)
            master = replace(master, addr=own or nodes[0].host)
        if spec.local:
            port = free_port()
        elif first.master_port == AUTO_PORT:
            port = AUTO_PORT  # the new master's guard takes one
        else:
            port = first.master_port + attempt
            port = port if port <= 65535 else first.master_port - attempt
        return plan_launch(replace(spec, nodes=nodes, master=master), target, port=port,
                           job_id=first.job_id, attempt=attempt,
                           max_restarts=policy.max_restarts)

    return Restarts(policy, replan)


def run_dir_for(plan: LaunchPlan, base: str | Path | None) -> Path:
    return Path(base or DEFAULT_RUNS_DIR) / plan.job_id


def run_rank_program(spec: ClusterSpec, program: Program, args: tuple[str, ...], *,
                     port: int | None, options: RunOptions, on_data: DataSink,
                     on_line: LineSink | None = None) -> RunResult:
    """Ship a rank program (packed with its parts) to every rank as ``-c`` code and run it
    through the launcher, its records going to ``on_data``. The run's logs are kept in a
    temporary directory when it fails (the result names it), removed when it succeeds."""
    code = pack_source(program)
    plan = prepare(spec, Target(code=code, args=args), port=port)
    tmp = Path(tempfile.mkdtemp(prefix=f"ptcluster-{program.name}-"))
    result = Runner(plan, transports(spec), tmp / plan.job_id, on_line=on_line, on_data=on_data,
                    options=options, ended_by=outside_stop(spec)).run()
    if result.ok:
        shutil.rmtree(tmp, ignore_errors=True)
    return result
