"""`ptcluster monitor` on this machine: signal handling (M4) and the streaming JSON mode."""

from __future__ import annotations

import json
import os
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


def test_a_table_taller_than_the_screen_shows_the_nodes_to_look_at_first() -> None:
    """Ten nodes of 8 GPUs on a 20-row screen: the unreachable node, then the straggler's
    node, then the first of the rest; the others counted in the caption, not drawn."""
    from ptcluster.cli.monitor_cmd import shown, table
    from ptcluster.monitor.watch import NodeView

    gpu = {"index": 0, "name": "H200", "util": 90, "mem_used": 1e9, "mem_total": 8e10}
    sample = {"cpu_percent": 10, "cpus": 64, "mem": {"used": 1e9, "total": 1e12},
              "net": {"rx_bps": 0, "tx_bps": 0}, "jobs": {}, "gpus": [gpu] * 8}
    views = [NodeView(f"n{i}", sample=sample) for i in range(10)]
    views[4] = NodeView("n4", error="unreachable: ssh: connection refused")
    figures = {"ranks": [{"rank": 72, "host": "n9", "wait_share": 0.1}],
               "current": {"ranks": [72]}}
    waits = {"n9": "r72 10% straggler"}
    picked, hidden = shown(views, waits, 20)
    assert [v.host for v in picked] == ["n0", "n4", "n9"] and hidden == 7  # 8 + 1 + 8 rows
    assert shown(views, waits, None) == (views, 0)
    drawn = table(views, figures, rows=20)
    assert drawn.row_count == 17 and drawn.caption and drawn.caption.startswith("7 more node")
    assert table(views, figures).row_count == 73 and table(views, figures).caption is None
