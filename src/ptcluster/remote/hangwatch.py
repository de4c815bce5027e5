"""The guard's view of whether its ranks make progress, and their stacks on demand.

Standard library only; shipped with the guard (inlined by ``remote.bootstrap``). The rank
server hands this module what comes on the ranks' ``probe`` connections (see
``launch/probe.py``, installed in every rank by the shim) and when each rank last printed; a
rank's stack dump is read from the file its probe names (in the guard's temp dir).

Progress, per rank, from what the node already has at no cost to the rank: its last output
line, the CPU time of its process tree (``/proc/PID/stat``, children such as data loader
workers included) and, when the flight recorder is on, the collectives it completed. A rank
that waits inside a collective (the recorder says so) makes no progress whatever its CPU does
(NCCL and gloo may poll). The guard sends ``idle`` (seconds since each rank last progressed)
with every heartbeat; the head decides what a hang is.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

STACK_SIGNAL = signal.SIGRTMIN + 7
"""Same expression as ``launch/probe.py``: the signal its faulthandler answers."""
MAX_STACK = 256 * 1024
"""Bytes of one rank's dump kept (a process with thousands of threads is cut there)."""
QUIET = 0.2
"""A rank's dump is complete when no byte came for this long (faulthandler sends no end mark)."""
CPU_FLOOR = 0.05
"""CPU seconds per second below which a rank counts as idle: a rank blocked in gloo's wait
measured 0.007 here; anything computing uses far more."""
TICK = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
PYSPY_TIMEOUT = 5.0
"""Seconds one ``py-spy dump`` may take (it pauses the rank while it reads its memory)."""
MAX_PYSPY = 64 * 1024


def find_pyspy() -> str | None:
    """py-spy (the ``stacks`` extra) next to the node's Python, or on PATH; None without it."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def pyspy_dump(exe: str, pid: int) -> dict[str, str]:
    """Native frames too, and whether a thread holds the GIL; ``{"pyspy": text}`` or
    ``{"pyspy_error": why}`` (py-spy needs ptrace rights: root or CAP_SYS_PTRACE here)."""
    try:
        proc = subprocess.run([exe, "dump", "--pid", str(pid), "--native"],
                              capture_output=True, text=True, timeout=PYSPY_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"pyspy_error": f"{type(exc).__name__}: {exc}"[:300]}
    if proc.returncode != 0:
        return {"pyspy_error": (proc.stderr.strip() or f"exit {proc.returncode}")[-300:]}
    return {"pyspy": proc.stdout[:MAX_PYSPY]}


class RankProbes:
    """What the ranks' probes said, fed by the rank server's selector thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.collecting = threading.Lock()
        self.ready: dict[int, tuple[Any, int, bool, str]] = {}
        """rank -> (probe connection, pid whose handler is installed, flight recorder on, the
        file its dumps go to)."""
        self.pids: dict[int, int] = {}
        """rank -> pid of the rank's process (the shim's start record), until it exits."""
        self.fr_counts: dict[int, dict[str, Any]] = {}
        self.fr_replies: dict[int, dict[str, Any]] = {}
        self.last_output: dict[int, float] = {}

    # -- fed by the rank server ---------------------------------------------------------------
    def started(self, rank: int, pid: int) -> None:
        self.pids[rank] = pid

    def ended(self, rank: int) -> None:
        self.pids.pop(rank, None)
        self.ready.pop(rank, None)

    def output(self, rank: int, at: float) -> None:
        self.last_output[rank] = at

    def feed(self, st: dict[str, Any], data: bytes) -> None:
        rank = st["rank"]
        lines = (st["buf"] + data).split(b"\n")
        st["buf"] = lines.pop()
        for line in lines:
            kind, _, payload = line.partition(b" ")
            try:
                body = json.loads(payload)
            except ValueError:
                continue
            if not isinstance(body, dict):
                continue
            if kind == b"ready":
                self.ready[rank] = (st["conn"], int(body.get("pid", 0)), bool(body.get("fr")),
                                    str(body.get("stk", "")))
            elif kind == b"progress":
                self.fr_counts[rank] = body
            elif kind == b"fr":
                with self.lock:
                    self.fr_replies[rank] = body

    def dropped(self, st: dict[str, Any]) -> None:
        if st.get("role") == "probe":
            entry = self.ready.get(st["rank"])
            if entry is not None and entry[0] is st.get("conn"):
                del self.ready[st["rank"]]  # exec'd or ended: never signal that pid again

    # -- stacks -------------------------------------------------------------------------------
    def collect(self, timeout: float = 2.5) -> dict[str, dict[str, Any]]:
        """Every rank's stacks: signal each rank whose probe is ready, ask its recorder, and
        wait (at most ``timeout`` s) for the dumps to be complete. One collection at a time."""
        with self.collecting:
            return self._collect(timeout)

    def _collect(self, timeout: float) -> dict[str, dict[str, Any]]:
        targets = dict(self.ready)
        with self.lock:
            for rank in targets:
                self.fr_replies.pop(rank, None)
        sent: dict[int, float] = {}
        start = {rank: _size(t[3]) for rank, t in targets.items()}
        grown: dict[int, tuple[int, float]] = {}  # rank -> (size, when it last grew)
        out: dict[str, dict[str, Any]] = {}
        for rank, (conn, pid, fr, _) in targets.items():
            if fr:
                try:
                    conn.sendall(b"fr\n")
                except OSError:
                    fr = False
            try:
                sent[rank] = time.monotonic()
                os.kill(pid, STACK_SIGNAL)
            except OSError as exc:
                out[str(rank)] = {"pid": pid, "text": "", "error": f"not signalled: {exc}"}
                sent.pop(rank)
        deadline = time.monotonic() + timeout
        fr_wait = min(deadline, time.monotonic() + 1.0)  # a held GIL never answers: not long
        while time.monotonic() < deadline:
            now = time.monotonic()
            for r in sent:
                size = _size(targets[r][3])
                if size > grown.get(r, (start[r], 0.0))[0]:
                    grown[r] = (size, now)
            dumps_done = all(r in grown and now - grown[r][1] > QUIET for r in sent)
            with self.lock:
                fr_done = now > fr_wait or all(r in self.fr_replies for r, t
                                               in targets.items() if t[2] and r in sent)
            if dumps_done and fr_done:
                break
            time.sleep(0.02)
        with self.lock:
            for rank, at in sent.items():
                text = _read(targets[rank][3], start[rank])
                done = grown[rank][1] if rank in grown else None
                entry: dict[str, Any] = {"pid": targets[rank][1], "text": text,
                                         "ms": None if done is None else
                                         round((done - at) * 1000, 1)}
                if rank in self.fr_replies:
                    entry["fr"] = self.fr_replies[rank]
                elif targets[rank][2]:
                    entry["fr_note"] = "no answer from the rank's probe thread (GIL held?)"
                if not text:
                    entry["error"] = "no stack came back"
                out[str(rank)] = entry
        exe = find_pyspy()
        if exe is not None and sent:  # after faulthandler: never two at a rank at once
            def spy(rank: int) -> None:
                out[str(rank)].update(pyspy_dump(exe, targets[rank][1]))
            spies = [threading.Thread(target=spy, args=(r,), daemon=True) for r in sent]
            for t in spies:
                t.start()
            for t in spies:
                t.join(PYSPY_TIMEOUT + 1.0)
        for rank, pid in self.pids.items():
            if str(rank) not in out:
                out[str(rank)] = {"pid": pid, "text": "",
                                  "error": "no probe in this rank (not started yet, or the "
                                           "program replaced its process)"}
        return out


class ProgressMeter:
    """Seconds since each running rank last made progress (sampled once per heartbeat)."""

    def __init__(self, probes: RankProbes, cpu_floor: float = CPU_FLOOR) -> None:
        self.probes = probes
        self.cpu_floor = cpu_floor
        self.state: dict[int, list[float]] = {}
        """rank -> [pid, cpu ticks, sampled at, last progress, completed collectives]."""

    def sample(self, now: float | None = None) -> dict[str, float]:
        now = time.monotonic() if now is None else now
        pids = dict(self.probes.pids)
        if not pids:
            self.state.clear()
            return {}
        table = proc_ticks()
        idle: dict[str, float] = {}
        for rank, pid in pids.items():
            ticks = tree_ticks(table, pid)
            counts = self.probes.fr_counts.get(rank) or {}
            completed = float(counts.get("completed", -1))
            st = self.state.get(rank)
            if st is None or st[0] != pid:
                st = self.state[rank] = [pid, ticks, now, now, completed]
            else:
                cpu = (ticks - st[1]) * TICK
                waiting = bool(counts.get("waiting"))
                if completed > st[4] or (not waiting and cpu >= self.cpu_floor * (now - st[2])):
                    st[3] = now
                st[1], st[2], st[4] = ticks, now, completed
            out_at = self.probes.last_output.get(rank)
            if out_at is not None and out_at > st[3]:
                st[3] = out_at
            idle[str(rank)] = round(max(0.0, now - st[3]), 1)
        for rank in list(self.state):
            if rank not in pids:
                del self.state[rank]
        return idle


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read(path: str, offset: int) -> str:
    """What a rank's dump file gained since ``offset`` (at most ``MAX_STACK`` bytes)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(MAX_STACK).decode(errors="replace")
    except OSError:
        return ""


def proc_ticks() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, utime + stime in ticks) of every process we can see."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 12:
            table[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def tree_ticks(table: dict[int, tuple[int, int]], root: int) -> int:
    """CPU ticks of ``root`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            total += table[pid][1]
        todo.extend(children.get(pid, ()))
    return total
