"""Benchmark collectives on every rank, nccl-tests style (sizes, algbw, busbw, #wrong); with
--predict, a job's step time at 1..N nodes from a brief run of it on the first node."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.markup import escape
from rich.text import Text

from ptcluster.bench.formulas import DTYPES, OPS, parse_size, sizes
from ptcluster.bench.probe import PredictConfig
from ptcluster.bench.sweep import BenchConfig, BenchResult, run_bench
from ptcluster.cli.common import (
    NPROC,
    PORT,
    SECONDS,
    FiniteFloat,
    cluster_option,
    load_spec,
    quiet,
    spec_for_our_ranks,
)
from ptcluster.cli.console import say, terminal
from ptcluster.cli.predict_view import job_target, run_prediction
from ptcluster.cli.problems import BELOW_MIN_BUSBW
from ptcluster.errors import PtclusterError, UsageError


class ByteSize(click.ParamType):
    """A size in bytes >= 1: 8, 64K, 64M, 1G (1024-based)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        try:
            size = value if isinstance(value, int) else parse_size(value)
        except UsageError as exc:
            self.fail(str(exc), param, ctx)
        if size < 1:
            self.fail(f"{value!r} is less than 1 byte.", param, ctx)
        return size


SIZE = ByteSize()


@click.command(help=__doc__ + "\n\nWith --predict, everything after -- is the job, as `ptcluster "
               "run` takes it: -m MODULE or SCRIPT, then its arguments.")
@cluster_option
@click.option("--nproc", type=NPROC, help="Processes on the local cluster.")
@click.option("--port", type=PORT, help="Rendezvous port.")
@click.option("--op", "op", type=click.Choice(OPS + ("all",)), default="all_reduce",
              show_default=True, help="The collective to time (all: every one, in turn).")
@click.option("-b", "--minbytes", type=SIZE, default="8", show_default=True,
              help="Smallest size (K/M/G).")
@click.option("-e", "--maxbytes", type=SIZE, default="64M", show_default=True,
              help="Largest size.")
@click.option("-f", "--stepfactor", type=click.IntRange(2), default=2, show_default=True,
              help="Multiply the size by this.")
@click.option("-i", "--stepbytes", type=SIZE, default=None, help="Add this many bytes instead "
              "of -f.")
@click.option("-n", "--iters", type=click.IntRange(1), default=20, show_default=True,
              help="Timed iterations per size (their mean is the figure).")
@click.option("-w", "--warmup", type=click.IntRange(0), default=5, show_default=True,
              help="Untimed iterations per size before the timed ones.")
@click.option("-c", "--check", type=click.IntRange(0), default=1, show_default=True,
              help="Verified runs per size (0: no check).")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="float32", show_default=True,
              help="Element type of the buffers.")
@click.option("--pairs", is_flag=True, help="Also a node-pair bandwidth matrix (sendrecv).")
@click.option("--pair-size", type=SIZE, default="16M", show_default=True,
              help="Message size of each node pair's sendrecv (with --pairs).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the result as JSON instead of the table (stdout: data only; with "
              "--predict: {rows, sweep, ...}).")
@click.option("-o", "--json-out", "json_file", metavar="FILE",
              help="Also write the result as JSON to FILE.")
@click.option("--plot", "plot_file", metavar="FILE.png",
              help="PNG of busbw and time against size, one line per op; with --pairs also "
              "FILE-pairs.png, the node-pair bandwidth heatmap; with --predict the predicted "
              "step time and efficiency per node count (needs the plot extra).")
@click.option("--min-busbw", type=FiniteFloat(min=0),
              help="Exit 1 when the average busbw (GB/s) is lower.")
@click.option("--timeout", type=SECONDS, default=600.0, show_default=True,
              help="Seconds for the whole sweep (with --predict: for the brief run, and for "
              "the sweep).")
@click.option("--predict", is_flag=True, help="Run the job after -- briefly on the first node, "
              "measure its step time and DDP gradient buckets, time the all-reduce at those "
              "sizes on the cluster, and predict its step time, samples/s and scaling "
              "efficiency at 1..N nodes (-n/-w default to 5/1 here).")
@click.option("--steps", type=click.IntRange(1), default=30, show_default=True,
              help="With --predict: measured optimizer steps of the brief run, at least (then "
              "it is ended).")
@click.option("--measure-seconds", type=FiniteFloat(min=0), default=3.0, show_default=True,
              help="With --predict: measure for this long at least (more steps when --steps "
              "took less); the sweep times each bucket size for this long too, 1 s at most.")
@click.option("--warmup-steps", type=click.IntRange(1), default=5, show_default=True,
              help="With --predict: steps before the measured ones.")
@click.option("--batch", type=click.IntRange(1), help="With --predict: samples per rank per "
              "step (default: the first dimension of the model's input).")
@click.argument("job", nargs=-1, type=click.UNPROCESSED, metavar="[-- JOB...]")
@click.pass_context
def bench(ctx: click.Context, cluster: str | None, nproc: int | None, port: int | None,
          op: str, minbytes: int, maxbytes: int, stepfactor: int, stepbytes: int | None,
          iters: int, warmup: int, check: int, dtype: str, pairs: bool, pair_size: int,
          as_json: bool, json_file: str | None, plot_file: str | None, min_busbw: float | None,
          timeout: float, predict: bool, steps: int, measure_seconds: float,
          warmup_steps: int, batch: int | None,
          job: tuple[str, ...]) -> None:
    if job and not predict:
        raise UsageError(f"unexpected argument {job[0]!r}", "a job after -- is for --predict: "
                         "ptcluster bench --predict -- -m MODULE")
    if predict:
        refuse_sweep_options(ctx)
        if ctx.get_parameter_source("iters") is ParameterSource.DEFAULT:
            iters = 5
        if ctx.get_parameter_source("warmup") is ParameterSource.DEFAULT:
            warmup = 1
        sweep = BenchConfig(ops=("all_reduce",), sizes=(8,), iters=iters, warmup=warmup,
                            check=check, dtype=dtype, timeout=timeout)
        run_prediction(load_spec(cluster, nproc), job_target(job), sweep,
                       PredictConfig(warmup=warmup_steps, steps=steps, batch=batch,
                                     min_s=measure_seconds, timeout=timeout),
                       port=port, as_json=as_json, json_file=json_file, plot_file=plot_file)
        return
    spec = spec_for_our_ranks(load_spec(cluster, nproc), "bench")
    cfg = BenchConfig(
        ops=OPS if op == "all" else (op,),
        sizes=tuple(sizes(minbytes, maxbytes, stepfactor, stepbytes)),
        iters=iters, warmup=warmup, check=check, dtype=dtype, pairs=pairs,
        pair_size=pair_size, timeout=timeout)
    err = terminal(stderr=True, soft_wrap=True)
    if not quiet():
        err.print(Text(f"ptcluster bench: {spec.world_size} rank(s) on {len(spec.nodes)} "
                       f"node(s), {', '.join(cfg.ops)}, {len(cfg.sizes)} size(s)", style="dim"))
    result = run_bench(spec, cfg, port=port)
    data = json.dumps(result.to_json(), indent=2)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        say(render(result, cfg))
    if json_file:
        Path(json_file).write_text(data + "\n")
    if plot_file:
        from ptcluster.bench.plot import write_plots

        for path in write_plots(result, plot_file):
            if not quiet():
                err.print(f"[dim]plot: {escape(str(path))}[/dim]", markup=True)
    if result.failure is not None:
        err.print(Text("bench failed:", style="red"), result.failure.headline())
        sys.exit(1)
    if result.wrong:
        sys.exit(1)
    if min_busbw is not None and result.avg_busbw < min_busbw:
        raise PtclusterError.of(BELOW_MIN_BUSBW, avg=f"{result.avg_busbw:.3f}",
                                min=f"{min_busbw:g}")


def refuse_sweep_options(ctx: click.Context) -> None:
    """The sweep's own sizes, ops and pairs have no meaning with --predict: refused if given."""
    for name in ("op", "minbytes", "maxbytes", "stepfactor", "stepbytes", "pairs",
                 "pair_size", "min_busbw"):
        if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
            raise UsageError(f"--{name.replace('_', '-')} has no meaning with --predict",
                             "--predict times the all-reduce at the job's own bucket sizes; "
                             "leave it out")


def render(result: BenchResult, cfg: BenchConfig) -> str:
    """nccl-tests' column layout, one block per op, then the footer."""
    out = [f"# ptcluster bench: {result.world_size} ranks, backend {result.backend or '?'}, "
           f"iters {cfg.iters}, warmup {cfg.warmup}, check {cfg.check}"]
    for op in dict.fromkeys(r.op for r in result.rows):
        out.append(f"#\n# {op}")
        out.append(f"# {'size':>12} {'count':>12} {'type':>9} {'redop':>6} {'root':>5} "
                   f"{'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}")
        out.append(f"# {'(B)':>12} {'(elements)':>12} {'':>9} {'':>6} {'':>5} "
                   f"{'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}")
        for r in (r for r in result.rows if r.op == op):
            out.append(f"  {r.size:>12} {r.count:>12} {r.type:>9} {r.redop:>6} {r.root:>5} "
                       f"{r.time_us:>10.2f} {r.algbw:>8.3f} {r.busbw:>8.3f} {r.wrong:>7}")
    for line in result.skipped:
        out.append(f"# skipped {line}")
    if result.pairs:
        hosts = list(dict.fromkeys([p["a"] for p in result.pairs] + [p["b"] for p in
                                                                     result.pairs]))
        width = max(len(h) for h in hosts) + 2
        out.append(f"#\n# node-pair bandwidth (GB/s, sendrecv ping-pong, "
                   f"{result.pairs[0]['bytes']} B)")
        out.append("# " + " " * width + "".join(f"{h:>{width}}" for h in hosts))
        gbps = {(p["a"], p["b"]): p["gbps"] for p in result.pairs}
        for a in hosts:
            cells = []
            for b in hosts:
                v = gbps.get((a, b), gbps.get((b, a)))
                cells.append(f"{'-' if v is None else f'{v:.3f}':>{width}}")
            out.append(f"# {a:<{width}}" + "".join(cells))
        if result.slowest_pair is not None:
            out.append(f"# {result.slowest_pair.line()}")
    status = "OK" if result.wrong == 0 else "FAILED"
    out.append(f"# Out of bounds values : {result.wrong} {status}")
    out.append(f"# Avg bus bandwidth    : {result.avg_busbw:.4f} GB/s")
    return "\n".join(out)
