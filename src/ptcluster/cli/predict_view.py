"""``bench --predict``'s console side: the job after ``--``, the progress lines, the table and
its sentences, ``--json``, ``--plot``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.text import Text

from ptcluster.bench.probe import PredictConfig, Prediction, run_predict
from ptcluster.bench.sweep import BenchConfig
from ptcluster.cli.common import quiet, spec_for_our_ranks
from ptcluster.cli.console import say, terminal
from ptcluster.cluster.model import ClusterSpec
from ptcluster.errors import UsageError
from ptcluster.launch.plan import Target


def job_target(job: tuple[str, ...]) -> Target:
    """``-m MODULE ARGS`` or ``SCRIPT ARGS`` (what follows ``--``) as a :class:`Target`."""
    if not job:
        raise UsageError("--predict needs the job to measure", "give it after --, as run takes "
                         "it: ptcluster bench --predict -- -m ptcluster.examples.mnist")
    if job[0] == "-m":
        if len(job) < 2:
            raise UsageError("-m needs a module", "e.g. -- -m ptcluster.examples.mnist")
        return Target(module=job[1], args=job[2:])
    if job[0].startswith("-m"):
        return Target(module=job[0][2:], args=job[1:])
    if job[0].startswith("-"):
        raise UsageError(f"the job starts with {job[0]!r}", "after -- give -m MODULE or SCRIPT, "
                         "then its arguments")
    return Target(script=job[0], args=job[1:])


def run_prediction(spec: ClusterSpec, target: Target, sweep: BenchConfig, cfg: PredictConfig, *,
                   port: int | None, as_json: bool, json_file: str | None,
                   plot_file: str | None) -> None:
    err = terminal(stderr=True, soft_wrap=True)
    first = spec.nodes[0]
    if not quiet():
        err.print(Text(f"ptcluster bench --predict: {cfg.warmup}+{cfg.steps} steps of "
                       f"{target.describe()} on {first.host} ({first.slots} rank(s)), then the "
                       f"all-reduce at its bucket sizes on {len(spec.nodes)} node(s)",
                       style="dim"))
    result = run_predict(spec, spec_for_our_ranks(spec, "bench"), target, cfg, sweep, port=port)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    elif result.rows:
        say(render(result))
    if json_file:
        Path(json_file).write_text(json.dumps(result.to_json(), indent=2) + "\n")
    if plot_file and result.rows:
        from ptcluster.bench.predict_plot import write_prediction_plot

        m = result.measured
        title = (f"ptcluster bench --predict\n{target.describe(width=70)}" + (
            "" if m is None else f", {m.grad_bytes / 1e6:.2f} MB of gradients a step"))
        path = write_prediction_plot(result.rows, plot_file, title)
        if not quiet():
            err.print(f"[dim]plot: {escape(str(path))}[/dim]", markup=True)
    if result.failure is not None:
        for line in result.output_tail:
            err.print(Text(line, style="dim"))
        err.print(Text("bench --predict failed:", style="red"), result.failure.headline())
        sys.exit(1)


def render(result: Prediction) -> str:
    m = result.measured
    assert m is not None
    over = f" (mean of {m.steps} steps)" if m.steps else ""
    out = [f"# measured on one node: {m.ranks} rank(s), {m.step_s * 1000:.2f} ms per step{over} "
           f"({m.compute_s * 1000:.2f} ms compute), {m.batch} samples per rank and step, "
           f"{m.grad_bytes / 1e6:.3f} MB of gradients in {len(m.buckets)} bucket(s)"
           f"{'' if m.ddp else ' (no DDP in the one-node run: DDP default buckets assumed)'}; "
           f"probe {result.probe_s:.1f} s, sweep {result.sweep_s:.1f} s"]
    if result.sweep is not None:
        bw = ", ".join(f"{r.size / 1e6:.3g} MB {r.busbw:.3f} GB/s" for r in result.sweep.rows)
        out.append(f"# all-reduce busbw on {result.sweep.world_size} ranks "
                   f"({result.sweep.backend or '?'}): {bw}")
    out.append(f"  {'nodes':>5} {'ranks':>5} {'step (ms)':>10} {'samples/s':>11} "
               f"{'efficiency':>10} {'bound':>8}")
    for r in result.rows:
        out.append(f"  {r.nodes:>5} {r.ranks:>5} {r.step_s * 1000:>10.2f} "
                   f"{r.samples_per_s:>11.1f} {r.efficiency:>10.0%} {r.bound:>8}")
    out += result.sentences
    return "\n".join(out)
