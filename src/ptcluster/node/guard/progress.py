"""The guard's view of whether its ranks make progress, and their stacks on demand.

Standard library only; shipped with the guard (shipped by ``remote.bootstrap``). The rank
server hands this module what comes on the ranks' ``probe`` connections (see
``node/rank/stack_probe.py``, installed in every rank by the shim) and when each rank last
printed; a rank's stack dump is read from the file its probe names (in the guard's temp dir).

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
import subprocess
import sys
import threading
import time
from typing import Any, Literal

from ptcluster.node.rank_wire import (
    DUMP,
    PROBE,
    PROGRESS,
    READY,
    STACK_SIGNAL,
    ProbeDump,
    ProbeProgress,
    ProbeReady,
    decode_record,
)
from ptcluster.node.wire import RankStacks

MAX_STACK = 256 * 1024
"""Bytes of one rank's dump kept (a process with thousands of threads is cut there)."""
ANSWER_WAIT = 1.0
"""Seconds for a rank's probe thread to answer before the rank counts as holding its GIL."""
SIGNAL_WAIT = 2.0
"""Seconds for faulthandler's dumps to arrive after the signal."""
QUIET = 0.2
"""A rank's dump is complete when no byte came for this long (faulthandler sends no end mark)."""
CPU_FLOOR = 0.05
"""CPU seconds per second below which a rank counts as idle: a rank blocked in gloo's wait
measured 0.007 here; anything computing uses far more."""
TICK = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
PYSPY_TIMEOUT = 5.0
"""Seconds one ``py-spy dump`` may take (it pauses the rank while it reads its memory)."""
MAX_PYSPY = 64 * 1024
CUT: tuple[Literal["text", "pyspy"], ...] = ("text", "pyspy")
"""A rank's texts :func:`fit_stacks` cuts."""


def find_pyspy() -> str | None:
    """py-spy (the ``stacks`` extra) next to the node's Python, or on PATH; None without it."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def pyspy_dump(exe: str, pid: int) -> RankStacks:
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


def fit_stacks(ranks: dict[str, RankStacks], limit: int) -> dict[str, RankStacks]:
    """``ranks`` (``StackProbes.collect``) cut until their JSON is at most ``limit`` bytes: the
    head closes a channel whose frame is longer (``wire.MAX_FRAME``). Each rank's texts keep
    their start, an equal share each, halved until they fit; flight-recorder entries go last."""
    share = limit // max(1, len(ranks))
    while len(json.dumps(ranks, separators=(",", ":"))) > limit:
        if share < 256:  # (thousands of ranks, or huge flight records: the texts alone stay)
            for rank in ranks.values():
                rank["fr"] = {"cut": "the stacks frame was too long"}
            share = 0
        for rank in ranks.values():
            for key in CUT:
                text = rank.get(key)
                if isinstance(text, str) and len(text) > share:
                    rank[key] = text[:share] + f"\n[cut at {share} characters: the stacks " \
                        "frame was too long]"
        if share == 0:
            break
        share //= 2
    return ranks


class StackProbes:
    """What the ranks' probes said, fed by the rank server's selector thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.collecting = threading.Lock()
        self.ready: dict[int, tuple[Any, int, bool, str]] = {}
        """rank -> (probe connection, pid whose handler is installed, flight recorder on, the
        file its dumps go to)."""
        self.pids: dict[int, int] = {}
        """rank -> pid of the rank's process (the shim's start record), until it exits."""
        self.fr_counts: dict[int, ProbeProgress] = {}
        self.dumps: dict[int, ProbeDump] = {}
        """rank -> the probe thread's answer to ``dump`` (text, fr, at)."""
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
            record = decode_record(line.decode(errors="replace"))
            if record is None:
                continue
            kind, body = record  # (this rank's probe's, as rank_wire declares each)
            if kind == READY:
                ready: ProbeReady = body
                self.ready[rank] = (st["conn"], int(ready.get("pid", 0)), bool(ready.get("fr")),
                                    str(ready.get("stk", "")))
            elif kind == PROGRESS:
                progress: ProbeProgress = body
                self.fr_counts[rank] = progress
            elif kind == DUMP:
                dump: ProbeDump = body
                dump["at"] = time.monotonic()
                with self.lock:
                    self.dumps[rank] = dump

    def dropped(self, st: dict[str, Any]) -> None:
        if st.get("role") == PROBE:
            entry = self.ready.get(st["rank"])
            if entry is not None and entry[0] is st.get("conn"):
                del self.ready[st["rank"]]  # exec'd or ended: never signal that pid again

    # -- stacks -------------------------------------------------------------------------------
    def collect(self, native: bool = False) -> dict[str, RankStacks]:
        """Every rank's stacks: first from the rank's probe thread (under the GIL: safe while
        the rank runs); a rank that cannot answer within ``ANSWER_WAIT`` s has a thread holding
        the GIL, so nothing runs Python there and faulthandler's dump by signal is safe. py-spy
        (when installed) adds native frames for those ranks, and for every rank when
        ``native`` (a hang report). One collection at a time."""
        with self.collecting:
            return self._collect(native)

    def _collect(self, native: bool) -> dict[str, RankStacks]:
        targets = dict(self.ready)
        with self.lock:
            for rank in targets:
                self.dumps.pop(rank, None)
        asked = time.monotonic()
        for conn, _, _, _ in targets.values():
            try:
                conn.sendall(DUMP.encode() + b"\n")
            except OSError:
                pass
        while time.monotonic() - asked < ANSWER_WAIT:
            with self.lock:
                if all(r in self.dumps for r in targets):
                    break
            time.sleep(0.01)
        out: dict[str, RankStacks] = {}
        with self.lock:
            for rank, answer in self.dumps.items():
                if rank in targets:
                    out[str(rank)] = {"pid": targets[rank][1], "how": "probe thread",
                                      "text": str(answer.get("text") or ""),
                                      "fr": answer.get("fr") or {},
                                      "ms": round((answer["at"] - asked) * 1000, 1)}
        silent = [r for r in targets if str(r) not in out]
        out.update(self._by_signal({r: targets[r] for r in silent}))
        exe = find_pyspy()
        spied = list(targets) if native else silent
        if exe is not None and spied:
            def spy(rank: int) -> None:
                out[str(rank)].update(pyspy_dump(exe, targets[rank][1]))
            spies = [threading.Thread(target=spy, args=(r,), daemon=True) for r in spied]
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

    def _by_signal(self, targets: dict[int, tuple[Any, int, bool, str]]
                   ) -> dict[str, RankStacks]:
        """faulthandler's dumps of ranks whose probe thread could not answer."""
        out: dict[str, RankStacks] = {}
        start = {rank: _size(t[3]) for rank, t in targets.items()}
        grown: dict[int, tuple[int, float]] = {}  # rank -> (size, when it last grew)
        sent: dict[int, float] = {}
        for rank, (_, pid, _, _) in targets.items():
            try:
                sent[rank] = time.monotonic()
                os.kill(pid, STACK_SIGNAL)
            except OSError as exc:
                out[str(rank)] = {"pid": pid, "text": "", "error": f"not signalled: {exc}"}
                sent.pop(rank)
        deadline = time.monotonic() + SIGNAL_WAIT
        while sent and time.monotonic() < deadline:
            now = time.monotonic()
            for r in sent:
                size = _size(targets[r][3])
                if size > grown.get(r, (start[r], 0.0))[0]:
                    grown[r] = (size, now)
            if all(r in grown and now - grown[r][1] > QUIET for r in sent):
                break
            time.sleep(0.02)
        for rank, at in sent.items():
            text = _read(targets[rank][3], start[rank])
            done = grown[rank][1] if rank in grown else None
            entry: RankStacks = {
                "pid": targets[rank][1], "text": text, "how": "signal (faulthandler)",
                "ms": None if done is None else round((done - at) * 1000, 1),
                "note": f"its probe thread did not answer in {ANSWER_WAIT:.0f} s: a thread "
                        "holds the GIL (C code that does not release it)"}
            if not text:
                entry["error"] = "no stack came back"
            out[str(rank)] = entry
        return out


class ProgressMeter:
    """Seconds since each running rank last made progress (sampled once per heartbeat)."""

    def __init__(self, probes: StackProbes, cpu_floor: float = CPU_FLOOR) -> None:
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
            counts = self.probes.fr_counts.get(rank)
            completed = float(counts.get("completed", -1)) if counts else -1.0
            st = self.state.get(rank)
            if st is None or st[0] != pid:
                st = self.state[rank] = [pid, ticks, now, now, completed]
            else:
                cpu = (ticks - st[1]) * TICK
                waiting = bool(counts and counts.get("waiting"))
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
