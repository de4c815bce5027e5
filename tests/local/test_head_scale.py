"""The head with many nodes (fake guards: ``tests/support/fakenode.py``, real runner, supervisor and
channels): constant threads, a descriptor budget, nothing lost. Each case runs the head in a
child process under its own open-file limit."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HEAD = textwrap.dedent("""
    import json, os, sys, threading
    sys.path.insert(0, sys.argv[1])
    from tests.support.fakenode import fake_job
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.runner import Runner

    plan, transports = fake_job(int(sys.argv[2]))
    peak = {"threads": 0, "fds": 0}
    done = threading.Event()

    def watch():
        while not done.wait(0.05):
            peak["threads"] = max(peak["threads"], threading.active_count())
            peak["fds"] = max(peak["fds"], len(os.listdir("/proc/self/fd")))

    threading.Thread(target=watch, daemon=True).start()
    asked = {}

    def ask_straggler():  # as `ptcluster monitor` does, on the job's control socket
        from ptcluster.control.protocol import ask
        while not done.wait(0.5):
            try:
                answer = ask(__import__("pathlib").Path(sys.argv[3]), {"cmd": "straggler"},
                             timeout=5.0)
            except Exception:  # (no socket yet)
                continue
            if len((answer.get("straggler") or {}).get("ranks", [])) == len(plan.nodes) * 8:
                asked.update(answer)  # (the first answer with every rank's full window)
                return

    if os.environ.get("ASK_STRAGGLER"):
        threading.Thread(target=ask_straggler, daemon=True).start()
    notes = []
    try:
        runner = Runner(plan, transports, __import__("pathlib").Path(sys.argv[3]),
                        on_status=notes.append, options=RunOptions(ready_timeout=120.0))
        result = runner.run()
        queued = runner.events.qsize()
        after = runner.door.straggler()  # (no loop any more: the last figures, at once)
        asked["after"] = {"asked_a_loop": runner.events.qsize() != queued,
                          "ranks": len(after["straggler"].get("ranks", []))}
    except Exception as exc:
        said = getattr(exc, "problem", None)
        print(json.dumps({"error": str(exc), "code": getattr(said, "code", None),
                          "fields": getattr(said, "fields", {})}))
        sys.exit(0)
    done.set()
    print(json.dumps({"ok": result.ok, "exits": {r.rank: r.exit_code for r in result.ranks},
                      "peak": peak, "notes": notes, "log_errors": result.log_errors,
                      "asked": asked}))
""")


def run_head(tmp_path: Path, nodes: int, nofile: int, **env: str) -> dict:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    events = tmp_path / "events"
    proc = subprocess.run(
        [sys.executable, "-c", HEAD, str(ROOT), str(nodes), str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, preexec_fn=limit,
        env={**os.environ, "FAKE_EVENTS": str(events), **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # (the hub logs what it catches)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["events"] = events.read_text().splitlines() if events.exists() else []
    return out


@pytest.mark.slow
def test_64_nodes_under_a_low_descriptor_limit_every_exit_and_line_arrives(tmp_path) -> None:
    # 64 nodes x 8 ranks: 512 rank logs and 192 channel pipes under a limit of 300 (a log
    # pool of 44 files): every rank's exit status and every line must still arrive.
    out = run_head(tmp_path, 64, 300, FAKE_RATE="4", FAKE_SECONDS="3")
    assert out.get("ok"), out
    assert sorted(int(r) for r in out["exits"]) == list(range(512))
    assert set(out["exits"].values()) == {0}
    assert out["log_errors"] == []
    sent = sum(int(e.split()[2]) for e in out["events"] if e.split()[1] == "sent")
    logged = {}
    for log in (tmp_path / "run").glob("rank*.log"):
        lines = log.read_text().splitlines()
        assert lines == [f"line {i}" for i in range(1, len(lines) + 1)], log  # in order, no gap
        logged[log.name] = len(lines)
    assert len(logged) == 512 and sent == sum(logged.values()) and sent >= 512 * 8
    assert out["peak"]["fds"] <= 300
    assert out["peak"]["threads"] <= 8, out["peak"]  # not one per node (was 4 per node)


def test_a_limit_too_low_for_the_nodes_fails_before_anything_starts(tmp_path) -> None:
    out = run_head(tmp_path, 64, 200)
    assert (out["code"], out["fields"]) == ("run.open-files-limit", {
        "nodes": "64", "need": "264", "per_node": "3", "rest": "72", "soft": "200"}), out
    assert out["events"] == []  # no fake node was started
    assert not (tmp_path / "run").exists()


def test_the_runners_backlog_holds_at_its_limit_and_frees_at_half_of_it(tmp_path) -> None:
    # Hysteresis: a hold lifted at BACKLOG - 1 would be taken again at the next batch, and the
    # hub would look at the held channels for nothing.
    from ptcluster.launch.attempt import BACKLOG
    from ptcluster.launch.runner import Runner
    from tests.support.fakenode import fake_job

    plan, transports = fake_job(1)
    runner = Runner(plan, transports, tmp_path / "run")
    for _ in range(BACKLOG - 1):
        runner.events.put((0, "f0", []))
    assert not runner.ctx.backlogged()
    runner.events.put((0, "f0", []))
    assert runner.ctx.backlogged()
    while runner.events.qsize() > BACKLOG // 2:
        runner.events.get()
        assert runner.ctx.backlogged()
    runner.events.get()
    assert not runner.ctx.backlogged()
    runner.events.put((0, "f0", []))  # (free again until the limit, not at half)
    assert not runner.ctx.backlogged()


@pytest.mark.slow
def test_the_control_socket_gets_the_straggler_figures_while_and_after_the_loop_runs(
        tmp_path) -> None:
    # The control socket's `straggler` (monitor's wait column) is answered by the runner's
    # loop from its own state, when asked (it was rebuilt every second: ~80 ms at 8192 ranks);
    # when no loop runs (between attempts, after the job), at once from the last figures.
    out = run_head(tmp_path, 16, 4096, FAKE_SECONDS="14", ASK_STRAGGLER="1")
    assert out.get("ok"), out
    answer = out["asked"]
    assert answer.get("ok"), answer
    figures = answer["straggler"]
    assert [r["rank"] for r in figures["ranks"]] == list(range(128))
    assert {r["wait_share"] for r in figures["ranks"]} == {0.49}
    assert figures["current"] is None
    assert answer["after"] == {"asked_a_loop": False, "ranks": 128}


def test_the_logs_are_written_at_a_fixed_rate_for_the_head() -> None:
    # One write per log file that got lines: past LOG_WRITES_PER_SECOND / 2 ranks the logs are
    # written less often, so that the head's system calls for logs stay at that rate.
    from ptcluster.launch.attempt import FLUSH_SECONDS, LOG_WRITES_PER_SECOND, flush_every
    from tests.support.fakenode import fake_job

    assert flush_every(fake_job(8)[0]) == FLUSH_SECONDS
    assert flush_every(fake_job(1024)[0]) == (1024 * 8 + 1024) / LOG_WRITES_PER_SECOND == 2.25
