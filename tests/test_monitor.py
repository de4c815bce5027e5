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
