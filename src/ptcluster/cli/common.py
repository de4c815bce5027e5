"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import click

from ptcluster.cli.console import say
from ptcluster.cli.problems import NPROC_NOT_LOCAL
from ptcluster.cluster import ClusterSpec, find_cluster_file, load_cluster_file, local_cluster
from ptcluster.cluster.load import DEFAULT_CLUSTER_FILE, load_project_keys
from ptcluster.cluster.slurm import allocation_from_env, describe, slurm_cluster
from ptcluster.cluster.trust import TRUST_ENV_VAR, TRUST_FLAG, TRUST_IT
from ptcluster.errors import PtclusterError, UsageError
from ptcluster.node.facts import accel
from ptcluster.remote.slurm import run_scontrol
from ptcluster.venvs.choice import EnvChoice, env_choice
from ptcluster.venvs.resolve import precheck

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class CliState:
    """What the top-level options asked for; the ``ctx.obj`` every subcommand can read."""

    verbose: int = 0
    """-v count: 1 info logs and tracebacks for errors, 2 debug logs."""
    quiet: bool = False
    """-q: print only the command's data and errors, no progress or status chatter."""
    trust_cluster_file: bool = False
    """--trust-cluster-file: the cluster file is the user's own; it may set what runs code
    on this machine (``cluster.trust``)."""
    error: PtclusterError | None = None
    """The error the command ended with (``main`` exits from it)."""


def state() -> CliState:
    """The running command's :class:`CliState` (defaults outside a command)."""
    ctx = click.get_current_context(silent=True)
    found = ctx.find_object(CliState) if ctx is not None else None
    return found if found is not None else CliState()


def quiet() -> bool:
    """True under ``ptcluster -q``: skip status lines, keep data and errors."""
    return state().quiet


class FiniteFloat(click.FloatRange):
    """A float in a range that is also finite: ``nan`` and ``inf`` are usage errors too."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


SECONDS = FiniteFloat(min=0, min_open=True)
"""A timeout or interval: seconds > 0."""
NPROC = click.IntRange(min=1)
PORT = click.IntRange(1, 65535)


def cluster_option(func: F) -> F:
    """``--cluster FILE`` and ``--trust-cluster-file`` (kept in :class:`CliState`, read by
    :func:`load_spec`): every command that reads a cluster file takes both."""
    func = click.option(
        TRUST_FLAG, is_flag=True, expose_value=False, callback=_trust,
        help="The cluster file is yours: let it set ssh options that run programs or change "
             f"host-key checks (ProxyCommand, UserKnownHostsFile, ...; also ${TRUST_ENV_VAR}=1).",
    )(func)
    return click.option(
        "--cluster", "cluster", metavar="FILE", default=None,
        help="Cluster file (default: ./cluster.yaml, else $PTCLUSTER_CLUSTER, else this machine).",
    )(func)


def environment_options(func: F) -> F:
    """``--requirements FILE``, ``--find-links DIR`` (repeatable) and ``--refresh``: the
    project's declared environment (``ptcluster.venvs``), for ``run``, ``doctor``, ``env`` and
    ``venvs``; read with :func:`environment`."""
    func = click.option("--refresh", is_flag=True, help="Resolve the requirements again, even "
                        "when this file's resolution is cached.")(func)
    func = click.option("--find-links", "find_links", multiple=True, metavar="DIR",
                        help="A folder of wheels to resolve the requirements from instead of "
                             "a package index (repeatable; adds to `find_links:`).")(func)
    return click.option(
        "--requirements", "requirements", metavar="FILE", default=None,
        help="The project's environment: a uv.lock, pylock.toml, requirements*.txt or "
             "pyproject.toml (wins over `requirements:`); the ranks run in it on every node.",
    )(func)


def environment(spec: ClusterSpec, requirements: str | None, find_links: tuple[str, ...],
                refresh: bool) -> EnvChoice | None:
    """The command's declared environment (None: none), checked as far as the head can
    without fetching anything (``venvs.resolve.precheck``): bad input is exit 2 before any
    node is touched."""
    vouched = trusted(spec.source) or (  # (in an allocation: the file whose keys apply)
        spec.slurm_job is not None and trusted(find_cluster_file(None)))
    choice = env_choice(spec, requirements, find_links, refresh, vouched)
    if choice is not None:
        precheck(choice.requirements, None, choice.find_links, choice.trusted)
    return choice


def _trust(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(CliState).trust_cluster_file = True


def local_gpu_count() -> int:
    """GPUs on this machine, without importing torch: the one GPU discovery the nodes use too
    (``node.facts.accel.gpus``: NVML, else nvidia-smi); 0 when none."""
    return int(accel.gpus()["count"])


def default_nproc() -> int:
    """GPUs on this machine, or 2 on a CPU-only one."""
    return local_gpu_count() or 2


def load_spec(cluster: str | None, nproc: int | None = None) -> ClusterSpec:
    """The cluster a command works on: ``--cluster``; else, inside a Slurm allocation, its
    nodes (announced on stderr); else ./cluster.yaml, $PTCLUSTER_CLUSTER, this machine."""
    if cluster is None:
        alloc = allocation_from_env()
        if alloc is not None:
            spec = slurm_cluster(alloc, nproc, scontrol=run_scontrol)
            if not quiet():
                say(describe(spec), err=True)
            return _project_keys(spec)
    path = find_cluster_file(cluster)
    if path is None:
        if nproc is not None and nproc < 1:  # run's --nproc is a plain int
            raise UsageError("--nproc must be >= 1", "pass --nproc 1 or more")
        return local_cluster(nproc or default_nproc())
    if nproc is not None:
        otherwise = "" if cluster else (
            f"; or, to run on this machine alone, run where no ./{DEFAULT_CLUSTER_FILE} is"
            if path == DEFAULT_CLUSTER_FILE else "; or, to run on this machine alone, unset "
            "$PTCLUSTER_CLUSTER")
        raise UsageError.of(NPROC_NOT_LOCAL, path=path, otherwise=otherwise)
    if cluster is None and not quiet():  # (found, not given: say which, as for Slurm above)
        where = "the current directory" if path == DEFAULT_CLUSTER_FILE else "$PTCLUSTER_CLUSTER"
        say(f"ptcluster: using the cluster file {path} (from {where})", err=True)
    return load_cluster_file(path, trusted=trusted(str(path)))


def _project_keys(spec: ClusterSpec) -> ClusterSpec:
    """Inside an allocation the nodes are Slurm's, but a cluster file found (./cluster.yaml,
    $PTCLUSTER_CLUSTER: in an ``sbatch`` job, the submit's) still says what the project needs:
    its ``requirements:``, ``find_links:`` and ``data:`` apply, with its trust rule."""
    path = find_cluster_file(None)
    if path is None:
        return spec
    keys = {k: v for k, v in load_project_keys(path, trusted(path)).items() if v}
    if keys and not quiet():
        say(f"ptcluster: {', '.join(f'{k}:' for k in keys)} from the cluster file {path} (its "
            "nodes are not used inside the allocation)", err=True)
    return replace(spec, **keys)


def trusted(path: str | None = None) -> bool:
    """Whether the user vouched for the cluster file at ``path`` (``cluster.trust``), and so
    for the requirements file it or a flag names:
    ``--trust-cluster-file``, or ``$PTCLUSTER_TRUST_CLUSTER_FILE`` naming that very file (an
    absolute path: one file of yours, never a cloned repository's found in the current
    directory later; L7), or ``1`` (every file: the old form, for scripts)."""
    if state().trust_cluster_file:
        return True
    said = os.environ.get(TRUST_ENV_VAR, "")
    if said.startswith("/"):
        return path is not None and os.path.realpath(path) == os.path.realpath(said)
    return said not in ("", "0")


def spec_for_our_ranks(spec: ClusterSpec, command: str) -> ClusterSpec:
    """The cluster for ranks that run ptcluster's own code (doctor's all-reduce, bench): a
    cluster file's ``env:`` (``PYTHONPATH``, ``LD_PRELOAD``: code) reaches them only when the
    user vouched for the file; said once when it is left out."""
    if not spec.env or trusted(spec.source):
        return spec
    if not quiet():
        say(f"ptcluster: {command} leaves out the cluster file's env: ({len(spec.env)} "
            f"variable(s)): its ranks run ptcluster's own code. Fix: {TRUST_IT}", err=True)
    return replace(spec, env=())
