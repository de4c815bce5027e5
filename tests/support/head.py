"""Helpers to run `ptcluster run` as a real subprocess and watch it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class Head:
    """A `ptcluster ...` process with its output collected live."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.cwd = cwd
        self.lines: list[str] = []
        self.err: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ptcluster", *args], cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})}, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self._threads = [threading.Thread(target=self._pump, args=(s, into), daemon=True)
                         for s, into in ((self.proc.stdout, self.lines),
                                         (self.proc.stderr, self.err))]
        for t in self._threads:
            t.start()

    def _pump(self, stream, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def wait_for(self, text: str, count: int = 1, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(text in line for line in self.lines) >= count:
                return
            if self.proc.poll() is not None:
                time.sleep(0.2)
                if sum(text in line for line in self.lines) >= count:
                    return
                raise AssertionError(f"exited {self.proc.returncode} before {text!r}:\n"
                                     + self.output())
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} after {timeout} s:\n" + self.output())

    def err_line(self, text: str, timeout: float = 120.0) -> str:
        """The first stderr line with ``text``, as soon as the head printed it (polled every
        50 ms: a caller timing it is late by that much at most)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((line for line in list(self.err) if text in line), None)
            if found is not None:
                return found
            if self.proc.poll() is not None:
                time.sleep(0.2)
                found = next((line for line in list(self.err) if text in line), None)
                if found is not None:
                    return found
                raise AssertionError(f"exited {self.proc.returncode} before {text!r}:\n"
                                     + self.output())
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} on stderr after {timeout} s:\n" + self.output())

    def wait(self, timeout: float = 300.0) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        for t in self._threads:
            t.join(timeout=5)
        return code

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def output(self) -> str:
        return "\n".join(self.lines[-60:] + ["--- stderr ---"] + self.err[-60:])


def run_head(args: list[str], cwd: Path, timeout: float = 300.0,
             env: dict[str, str] | None = None) -> tuple[int, Head]:
    head = Head(args, cwd, env)
    try:
        return head.wait(timeout), head
    finally:
        if head.proc.poll() is None:
            head.kill()


def only_run(runs: Path) -> tuple[str, dict]:
    """The job id and summary.json of the single run under ``runs``."""
    (run,) = [p for p in runs.iterdir() if p.is_dir()]
    summary = run / "summary.json"
    return run.name, json.loads(summary.read_text()) if summary.exists() else {}


def job_id_when_started(runs: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if runs.is_dir():
            found = [p.name for p in runs.iterdir() if p.is_dir()]
            if found:
                return found[0]
        time.sleep(0.05)
    raise AssertionError("no run directory appeared")


def by_rank(lines: list[str]) -> dict[tuple[str, int], list[str]]:
    """(node, rank) -> the lines that rank printed (stdout and stderr, in the order the head
    printed them), from a head's ``[node:rank] text`` prefixed output; node lines (``[node]``)
    and the head's own are left out."""
    out: dict[tuple[str, int], list[str]] = {}
    for line in lines:
        m = re.match(r"\[([^]\s]+):(\d+)\] ?(.*)", line)
        if m:
            out.setdefault((m.group(1), int(m.group(2))), []).append(m.group(3))
    return out


def closing_table(lines: list[str]) -> dict[int, dict[str, str]]:
    """rank -> its row of the table a run ends with (``rank``, ``host``, ``local``, ``status``,
    ``duration``: the columns by the table's head), from the head's stderr lines."""
    head = next(line for line in lines if line.startswith("┃"))
    names = [cell.strip() for cell in head.strip("┃").split("┃")]
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        if line.startswith("│") and len(cells) == len(names) and cells[0].isdigit():
            rows[int(cells[0])] = dict(zip(names, cells, strict=True))
    return rows


def rank_fields(lines: list[str]) -> dict[int, dict[str, str]]:
    """rank -> the fields of the reference trainer's ``rank=R params_sha256=... start_epoch=N``
    line, from a head's prefixed output."""
    out = {}
    for line in lines:
        m = re.match(r"\[[^]]+:(\d+)\] (rank=\d+ params_sha256=.*)", line)
        if m:
            fields = dict(f.split("=", 1) for f in m.group(2).split())
            assert fields["rank"] == m.group(1)
            out[int(m.group(1))] = fields
    return out
