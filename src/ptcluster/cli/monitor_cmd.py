"""A live table of every node: GPU util, memory, power, temperature, CPU, RAM, network, jobs, and
the running job's wait share per rank (the straggler report)."""

from __future__ import annotations

import json
import signal
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import click
from rich.console import Console
from rich.live import Live
from rich.segment import Segment, SegmentLines
from rich.table import Table
from rich.text import Text

from ptcluster.cli.common import SECONDS, FiniteFloat, cluster_option, load_spec
from ptcluster.cli.console import say, terminal
from ptcluster.monitor import httpd, metrics
from ptcluster.monitor.watch import Monitor, NodeView, job_straggler, node_waits
from ptcluster.remote.connect import transports
from ptcluster.rundir import DEFAULT_RUNS_DIR

GB = 1e9


@click.command(help=__doc__)
@cluster_option
@click.option("--interval", type=FiniteFloat(min=0.2), default=2.0, show_default=True,
              help="Seconds between samples.")
@click.option("--once", is_flag=True, help="One sample of every node, then exit.")
@click.option("--json", "as_json", is_flag=True, help="JSON (with --once: one object).")
@click.option("--timeout", type=SECONDS, default=20.0, show_default=True,
              help="Seconds to wait for the first sample of every node.")
@click.option("--run-dir", "runs_dir", metavar="DIR", help="Parent of the run directories whose "
              "running job's wait shares are shown (default: ./ptcluster-runs).")
@click.option("--serve", metavar="[ADDR:]PORT", help="Serve Prometheus metrics on "
              "http://ADDR:PORT/metrics (localhost unless ADDR is given) instead of the table, "
              "until Ctrl-C.")
@click.option("--serve-token-file", "token_file", metavar="FILE", help="With --serve: every "
              "scrape must carry 'Authorization: Bearer TOKEN', TOKEN being this file's "
              "content (Prometheus: authorization: {credentials_file: FILE}).")
@click.option("--serve-cert", "cert", metavar="FILE", help="With --serve and --serve-key: "
              "HTTPS with this PEM certificate (chain).")
@click.option("--serve-key", "key", metavar="FILE", help="The PEM private key of --serve-cert.")
def monitor(cluster: str | None, interval: float, once: bool, as_json: bool,
            timeout: float, runs_dir: str | None, serve: str | None, token_file: str | None,
            cert: str | None, key: str | None) -> None:
    listen, guard = None, Guard()
    if serve is None and (token_file or cert or key):
        raise click.UsageError("--serve-token-file, --serve-cert and --serve-key go with "
                               "--serve")
    if serve is not None:
        if once or as_json:
            raise click.UsageError("--serve runs until stopped: not with --once or --json")
        if (cert is None) != (key is None):
            raise click.UsageError("--serve-cert and --serve-key go together")
        try:
            listen = metrics.parse_listen(serve)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--serve") from None
        guard = Guard(token=httpd.read_token(token_file) if token_file else None,
                      tls=httpd.tls_context(cert, key) if cert and key else None)
    spec = load_spec(cluster, None)
    runs = Path(runs_dir or DEFAULT_RUNS_DIR)
    mon = Monitor(spec, transports(spec), interval=interval)
    try:
        if listen is not None:
            serve_metrics(mon, listen, interval, guard=guard)
            return
        mon.wait_first(timeout)
        if once:
            views = mon.snapshot()
            if as_json:
                click.echo(json.dumps(to_json(views, job_straggler(runs)), indent=2))
            else:
                terminal(width=None if sys.stdout.isatty() else 160).print(
                    table(views, job_straggler(runs)))
            return
        with stop_on_signals() as stop:
            watch(mon, runs, interval, as_json, stop)
    finally:
        mon.close()


REOPEN_SECONDS = 5.0
"""How long ``--serve`` waits before it opens a new session to a node whose last one ended."""


@dataclass(frozen=True)
class Guard:
    """What ``--serve`` asks of a scraper: a bearer token, TLS (None: not asked)."""

    token: str | None = None
    tls: ssl.SSLContext | None = None


def serve_metrics(mon: Monitor, listen: tuple[str, int], interval: float,
                  stop: threading.Event | None = None, guard: Guard = Guard()) -> None:
    """``--serve``: ``/metrics`` until Ctrl-C or SIGTERM (or ``stop``, when given); a node
    whose session ends is asked again every :data:`REOPEN_SECONDS` (an exporter runs for days:
    a node that comes back is seen again)."""
    poller = metrics.HeadPoller(interval=max(interval, 2.0)).start()
    # a node is down after 3 missed samples (and 2 s more for a slow link)
    exporter = metrics.Exporter(mon.snapshot, lambda: poller.latest, stale=3 * interval + 2.0)
    try:
        server = metrics.serve(exporter, *listen, token=guard.token, tls=guard.tls)
    except OSError as exc:
        poller.stop()
        raise click.ClickException(f"cannot serve on {listen[0]}:{listen[1]}: "
                                   f"{exc.strerror or exc}") from None
    host, port = server.server_address[:2]
    scheme = "https" if guard.tls else "http"
    say(f"serving Prometheus metrics on {scheme}://{_url_host(str(host))}:{port}/metrics "
        + ("(a bearer token needed; " if guard.token else "(") + "Ctrl-C ends)")
    try:
        with stop_on_signals() if stop is None else nullcontext(stop) as until:
            while not until.wait(min(interval, 1.0)):
                mon.reopen(REOPEN_SECONDS)
    finally:
        poller.stop()
        server.shutdown()
        server.server_close()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def watch(mon: Monitor, runs: Path, interval: float, as_json: bool, stop: threading.Event,
          console: Console | None = None) -> None:
    """Until ``stop``: a JSON line per interval, or the live table (on ``console``, default a
    :func:`terminal`)."""
    if as_json:
        while not stop.wait(interval):
            click.echo(json.dumps(to_json(mon.snapshot(), job_straggler(runs))))
        return
    # Drawn once a second (at most), not 4 times: on a large cluster one drawing of the
    # table is most of what the monitor costs (benchmarks/monitor_scale.py)
    with Live(console=console or terminal(), auto_refresh=False, screen=False) as live:
        while True:
            views, figures = mon.snapshot(), job_straggler(runs)
            live.update(SegmentLines(_fit(live.console, views, figures)[1], new_lines=True)
                        if live.console.is_terminal else table(views, figures),
                        refresh=True)  # (not a screen: every node)
            if stop.wait(min(interval, 1.0)):
                return


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event that Ctrl-C or SIGTERM sets (instead of killing us mid-update); the previous
    handlers are back when the block ends. Off the main thread, where Python cannot install
    handlers, the event is only set by the caller."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def to_json(views: list[NodeView], straggler: dict | None = None) -> dict:
    """Every node's sample; ``straggler``: the running job's figures (None: no job here)."""
    return {"time": time.time(),
            "nodes": [{"host": v.host, "ok": v.sample is not None and v.error is None,
                       "error": v.error, "sample": v.sample} for v in views],
            "straggler": straggler}


def _rate(bps: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} B/s"


TABLE_FRAME = 6
"""Lines of the live table that are not nodes' rows: its title (two lines where it wraps),
borders and header."""


def shown(views: list[NodeView], waits: dict[str, str],
          rows: int | None) -> tuple[list[NodeView], int]:
    """The nodes that fit in ``rows`` rows (a row per GPU; all, in the file's order, when
    None), and how many do not.

    When not all fit, the ones to look at come first: no sample or an error, then a node with
    the straggler, then the rest in the cluster file's order; at least one node is shown. Only
    the nodes shown are drawn, so the cost of a refresh does not grow with the cluster (rich
    draws ~1 ms a row here)."""
    if rows is None:
        return views, 0

    def order(v: NodeView) -> int:
        return 0 if v.sample is None or v.error else 1 if "straggler" in waits.get(v.host, "") \
            else 2
    picked: list[NodeView] = []
    used = 0
    for v in sorted(views, key=order):  # (stable: the file's order within each group)
        need = max(1, len(v.sample["gpus"])) if v.sample and not v.error else 1
        if used + need > rows and picked:
            continue
        picked.append(v)
        used += need
    return picked, len(views) - len(picked)


def fitted(console: Console, views: list[NodeView], straggler: dict | None) -> Table:
    """The live table, as many nodes as fit on ``console``'s screen (rows wrap on a narrow
    one: the rows are counted again from a first drawing, at most three times)."""
    return _fit(console, views, straggler)[0]


def _fit(console: Console, views: list[NodeView],
         straggler: dict | None) -> tuple[Table, list[list[Segment]]]:
    """``fitted``'s table and its drawing on ``console`` (shown as it is: not drawn again)."""
    height = console.height
    rows = max(1, height - TABLE_FRAME)
    for tries in range(4):
        drawn = table(views, straggler, rows)
        lines = console.render_lines(drawn, pad=False)
        if len(lines) <= height or rows <= 1 or tries == 3:
            break
        per_row = max(1.0, (len(lines) - TABLE_FRAME) / max(1, drawn.row_count))
        rows = max(1, min(rows - 1, int((height - TABLE_FRAME) / per_row)))
    return drawn, lines


def table(views: list[NodeView], straggler: dict | None = None,
          rows: int | None = None) -> Table:
    """Every node's row(s); with ``rows`` (the live table), only the nodes that fit in that
    many rows, the ones to look at first (``shown``). What nodes say (GPU names, errors,
    users) is text, never markup."""
    waits = node_waits(straggler)
    views, hidden = shown(views, waits, rows)
    more = f"  ({hidden} more node(s) not shown: --once or --json shows all)" if hidden else ""
    t = Table(title=f"ptcluster monitor  {time.strftime('%H:%M:%S')}{more}",
              title_justify="left")
    for col in ("node", "gpu", "util", "gpu mem", "power", "temp", "cpu", "ram", "net rx",
                "net tx", "jobs", "wait"):
        t.add_column(col)
    for v in views:
        s = v.sample
        if s is None or v.error:
            t.add_row(v.host, Text(v.error or "waiting…", style="red"), *[""] * 10)
            continue
        cpu = f"{s['cpu_percent']:.0f}% of {s['cpus']}"
        ram = f"{s['mem']['used'] / GB:.1f}/{s['mem']['total'] / GB:.1f} GB"
        jobs = ", ".join(
            f"{j} ({info.get('user')}, {info.get('ranks')} rank(s)"
            + (f", GPUs {','.join(map(str, info['gpus']))}" if info.get("gpus") else "") + ")"
            for j, info in s["jobs"].items()) or "-"
        common = [cpu, ram, _rate(s["net"]["rx_bps"]), _rate(s["net"]["tx_bps"]), jobs,
                  waits.get(v.host, "-")]
        if not s["gpus"]:
            t.add_row(v.host, Text("no GPU", style="dim"), "", "", "", "", *common)
        for i, g in enumerate(s["gpus"]):
            power = (f"{g['power_w']:.0f}/{g['power_limit_w']:.0f} W"
                     if g.get("power_w") is not None else "-")
            temp = f"{g['temp_c']} C" if g.get("temp_c") is not None else "-"
            t.add_row(v.host if i == 0 else "", f"{g['index']} {g['name']}", f"{g['util']}%",
                      f"{g['mem_used'] / GB:.1f}/{g['mem_total'] / GB:.1f} GB", power, temp,
                      *(common if i == 0 else [""] * 6))
    return t
