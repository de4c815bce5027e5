"""`ptcluster monitor` on this machine: signal handling (M4) and the streaming JSON mode."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from ptcluster.cli.monitor_cmd import stop_on_signals

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def handlers() -> dict[int, object]:
    return {sig: signal.getsignal(sig) for sig in SIGNALS}


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_sets_the_event_and_the_old_handlers_come_back(sig: int) -> None:
    before = handlers()
    with stop_on_signals() as stop:
        assert handlers() != before
        os.kill(os.getpid(), sig)  # a real signal; our handler must take it
        assert stop.wait(5)
    assert handlers() == before


def test_handlers_come_back_when_the_block_raises() -> None:
    before = handlers()
    with pytest.raises(RuntimeError), stop_on_signals():
        raise RuntimeError("boom")
    assert handlers() == before


def test_monitor_json_stream_ends_cleanly_on_ctrl_c(console_script: Path) -> None:
    proc = subprocess.Popen([str(console_script), "monitor", "--json", "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    try:
        # the handlers are in place before the first streamed sample is printed
        first = json.loads(proc.stdout.readline())
        assert [n["host"] for n in first["nodes"]] == ["localhost"]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    for line in out.splitlines():
        json.loads(line)


def not_shown(table) -> int | None:  # type: ignore[no-untyped-def]
    """How many nodes the live table's title says it leaves out (None: it says none)."""
    said = re.fullmatch(r"ptcluster monitor  \d\d:\d\d:\d\d(?:  \((\d+) more node\(s\) not "
                        r"shown: --once or --json shows all\))?", str(table.title))
    assert said, table.title
    return None if said.group(1) is None else int(said.group(1))


def test_a_table_taller_than_the_screen_shows_the_nodes_to_look_at_first() -> None:
    """Ten nodes of 8 GPUs, 20 rows: the unreachable node, then the straggler's node, then the
    first of the rest; the others counted in the title, not drawn. On a narrow screen, where
    rows wrap, fewer nodes, so that the table is no higher than the screen."""
    import io

    from rich.console import Console

    from ptcluster.cli.monitor_cmd import fitted, shown, table
    from ptcluster.monitor.watch import NodeView

    gpu = {"index": 0, "name": "NVIDIA H200", "util": 90, "mem_used": 1e9, "mem_total": 8e10,
           "power_w": 650.0, "power_limit_w": 700.0, "temp_c": 61}
    sample = {"cpu_percent": 10, "cpus": 64, "mem": {"used": 1e9, "total": 1e12},
              "net": {"rx_bps": 2e9, "tx_bps": 2e9}, "gpus": [gpu] * 8,
              "jobs": {"20261202-010000-abcdef": {"user": "ann", "ranks": 8, "gpus": [0, 1]}}}
    views = [NodeView(f"node-{i:04d}.cluster.example.org", sample=sample) for i in range(10)]
    views[4] = NodeView(views[4].host, error="unreachable: ssh: connect to host: refused")
    figures = {"ranks": [{"rank": 72, "host": views[9].host, "wait_share": 0.1}],
               "current": {"ranks": [72]}}
    waits = {views[9].host: "r72 10% straggler"}
    picked, hidden = shown(views, waits, 20)
    assert picked == [views[4], views[9], views[0]] and hidden == 7  # 1 + 8 + 8 rows
    assert shown(views, waits, None) == (views, 0)
    assert shown(views, {}, 3) == ([views[4]], 9)  # (a node of 8 GPUs would not fit)
    assert shown(views[:1], {}, 3) == ([views[0]], 0)  # (but one node always is)
    drawn = table(views, figures, rows=20)
    assert drawn.row_count == 17 and not_shown(drawn) == 7, drawn.title
    assert [cell for cell in drawn.columns[0].cells if cell] == [v.host for v in picked]
    full = table(views, figures)
    assert full.row_count == 73 and not_shown(full) is None
    counts = {}
    for width, height in ((200, 40), (80, 40), (80, 12)):
        console = Console(file=io.StringIO(), width=width, height=height, force_terminal=True)
        fit = fitted(console, views, figures)
        assert len(console.render_lines(fit, pad=False)) <= height or fit.row_count == 1, \
            (width, height)  # (one node is always shown: Live crops what does not fit)
        hosts = [cell for cell in fit.columns[0].cells if cell]
        assert not_shown(fit) == len(views) - len(hosts) > 0, fit.title
        counts[width, height] = fit.row_count
    assert counts[200, 40] > counts[80, 40] > counts[80, 12] >= 1, counts


def test_serve_answers_prometheus_and_ends_cleanly(console_script: Path) -> None:
    """``monitor --serve`` on the local cluster: /metrics in Prometheus' text format (parsed by
    the client library's own parser), gzip when asked (Prometheus asks), and on Ctrl-C exit 0
    with the port closed."""
    import gzip
    import socket
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(console_script), "monitor", "--interval", "0.5", "--serve",
                             f"127.0.0.1:{port}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().startswith(
            f"serving Prometheus metrics on http://127.0.0.1:{port}/metrics")
        deadline, up = time.monotonic() + 30, {}
        while time.monotonic() < deadline and up.get("localhost") != 1:
            ask = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                         headers={"Accept-Encoding": "gzip"})
            with urllib.request.urlopen(ask, timeout=10) as r:
                assert r.headers["Content-Encoding"] == "gzip"
                assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = gzip.decompress(r.read()).decode()
            fams = {f.name: f for f in text_string_to_metric_families(text)}
            up = {s.labels["node"]: s.value for s in fams["ptcluster_node_up"].samples}
            time.sleep(0.2)
        assert up == {"localhost": 1}
        (cpus,) = fams["ptcluster_node_cpus"].samples
        assert cpus.value == os.cpu_count()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


@pytest.mark.parametrize("args, says", [
    (["--serve", "x"], "not [ADDR:]PORT"),
    (["--serve", "9464", "--once"], "not with --once or --json"),
    (["--serve", "9464", "--json"], "not with --once or --json"),
    (["--serve-token-file", "/etc/hostname"], "go with --serve"),
    (["--serve", "9464", "--serve-cert", "c.pem"], "--serve-cert and --serve-key go together"),
    (["--serve", "9464", "--serve-token-file", "/etc/hostname"], "others can read it")])
def test_serve_refuses_what_it_cannot_do(cli, args: list[str], says: str) -> None:
    code, out, err = cli("monitor", *args)
    assert code == 2 and says in err, (out, err)


def test_serve_on_a_port_in_use_says_so(cli) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, out, err = cli("monitor", "--serve", f"127.0.0.1:{port}")
    assert code == 1 and f"cannot serve on 127.0.0.1:{port}: Address already in use" in err, \
        (out, err)
