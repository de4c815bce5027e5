"""The launcher as a library (torch's ``launcher/api.py``): plan a job, or run a shipped rank
program through the same runner (doctor's all-reduce, bench's workers)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ptcluster.cluster.model import ClusterSpec
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import LaunchPlan, Target, new_job_id, plan_launch
from ptcluster.launch.port import resolve_port
from ptcluster.launch.result import RunResult
from ptcluster.launch.runner import DataSink, LineSink, Runner
from ptcluster.node import Program
from ptcluster.remote.bootstrap import pack_source
from ptcluster.remote.connect import outside_stop, transports


def prepare(spec: ClusterSpec, target: Target, port: int | None = None,
            job_id: str | None = None, max_restarts: int = 0) -> LaunchPlan:
    """The first attempt's plan of ``target`` on ``spec``: its port resolved, a new job id."""
    return plan_launch(spec, target, port=resolve_port(spec, port), job_id=job_id or new_job_id(),
                       max_restarts=max_restarts)


def run_rank_program(spec: ClusterSpec, program: Program, args: tuple[str, ...], *,
                     port: int | None, options: RunOptions, on_data: DataSink,
                     on_line: LineSink | None = None) -> RunResult:
    """Ship a rank program (packed with its modules) to every rank as ``-c`` code and run it
    through the launcher, its records going to ``on_data``. The run's logs are kept in a
    temporary directory when it fails (the result names it), removed when it succeeds."""
    return run_target(spec, Target(code=pack_source(program), args=args), program.name,
                      port=port, options=options, on_data=on_data, on_line=on_line)


def run_target(spec: ClusterSpec, target: Target, label: str, *, port: int | None,
               options: RunOptions, on_data: DataSink,
               on_line: LineSink | None = None) -> RunResult:
    """Run ``target`` through the launcher (a shipped program's code, or a user's job for
    ``bench --predict``), its records going to ``on_data``; logs kept in a temporary directory
    (``ptcluster-LABEL-*``) when it fails, removed when it succeeds."""
    plan = prepare(spec, target, port=port)
    tmp = Path(tempfile.mkdtemp(prefix=f"ptcluster-{label}-"))
    result = Runner(plan, transports(spec), tmp / plan.job_id, on_line=on_line, on_data=on_data,
                    options=options, ended_by=outside_stop(spec)).run()
    if result.ok:
        shutil.rmtree(tmp, ignore_errors=True)
    return result
