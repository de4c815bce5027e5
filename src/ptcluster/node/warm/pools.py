"""This user's warm pools on this node: listed (``ps``, through the sampler) and ended
(``ptcluster warm stop``: this module is its node program).

Standard library only (shipped like the others). The pools' records live in this user's
private folder (``guard.tmpdirs.user_tmp``/``warm``); each is read as a regular file of ours
(never a link), believed only while its pid is a pool of ours (its ``/proc`` entry is our uid's
and its command line is the pool's boot), and removed with the pool's socket where its pid is
gone (a pool killed by SIGKILL leaves them).

  stdin  line 2  JSON config: {"stop": bool, "job": JOB_ID (only the pools kept for that job's
                 restarts: its head decided none follows)}
  stdout         frames of ``node.wire``: ``hello``, then ``result {pools, stopped}``
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from typing import TypedDict

from ptcluster.node.guard.tmpdirs import runtime_dir
from ptcluster.node.sharing.records import read_record
from ptcluster.node.warm.protocol import POOL_BOOT, WARM_DIR, drop_key, namespaces
from ptcluster.node.wire import Kind, PoolInfo, PoolStopped, WarmAnswer, encode, hello

STOP_WAIT = 5.0
"""Seconds ``warm stop`` waits for an idle pool to be gone (one whose ranks run ends with them)."""


def folder() -> str:
    """This user's pools' folder (as ``guard.tmpdirs.user_tmp`` names it; never made here)."""
    base = runtime_dir() or tempfile.gettempdir()
    return os.path.join(base, f"ptcluster-{os.getuid()}", WARM_DIR)


def is_pool(pid: int) -> bool:
    """Whether ``pid`` is a warm pool of this user's (its uid, its boot on its command line)."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(1 << 16).split(b"\0")
    except OSError:
        return False
    return POOL_BOOT.encode() in argv


def rss(pid: int) -> int:
    """The pool's resident memory in bytes (0: unknown)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def listed() -> list[PoolInfo]:
    """Every live pool of this user's here: pid, memory, idle since (None: ranks run), its
    running ranks, idle timeout, torch, python, started; what dead ones left is removed."""
    where, here = folder(), namespaces()
    out: list[PoolInfo] = []
    try:
        names = sorted(os.listdir(where))
    except OSError:
        return []
    for name in names:
        if not (name.startswith("pool-") and name.endswith(".json")):
            continue
        path = os.path.join(where, name)
        got = read_record(path, owners=(os.getuid(),))
        record = got[0] if got is not None else None
        if isinstance(record, dict) and record.get("place") != here:
            continue  # another node's (a /tmp shared across namespaces): its own to list
        pid = record.get("pid") if isinstance(record, dict) else None
        if not isinstance(pid, int) or not is_pool(pid):
            base = path[:-len(".json")]
            drop_key(base + ".lock", (path, base + ".sock"))
            continue
        assert isinstance(record, dict)
        out.append({"pid": pid, "rss": rss(pid), "idle_since": _time(record.get("idle_since")),
                    "ranks": _count(record.get("ranks")), "idle": _time(record.get("idle")),
                    "torch": str(record.get("torch") or "")[:64],
                    "python": str(record.get("python") or "")[:256],
                    "started": _time(record.get("started")),
                    "job": _job(record.get("job"))})
    return out


def _job(value: object) -> str | None:
    """The job a pool is kept for (``JOB@HOST``: its restarts' ranks come from it), None for a
    user's own (``run --warm``)."""
    if isinstance(value, str):
        return value[:200]
    return "" if value is True else None


def _time(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and 0 <= value < 1e11 else None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def stop(job: str = "") -> list[PoolStopped]:
    """SIGTERM every pool of this user's here: an idle one ends at once, one whose ranks run
    takes no new rank and ends with them; each with whether it is gone. A job's pool is not
    the user's to end so (it ends with its job, and a restart's ranks come from it); with
    ``job``, only that job's pools (kept for a restart its head decided against)."""
    pools = [p for p in listed() if (p["job"] or "").startswith(job + "@")] if job else \
        [p for p in listed() if p["job"] is None]
    for pool in pools:
        try:
            os.kill(pool["pid"], signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + STOP_WAIT
    while time.monotonic() < deadline and any(is_pool(p["pid"]) for p in pools):
        time.sleep(0.05)
    return [{"pid": p["pid"], "gone": not is_pool(p["pid"]), "ranks": p["ranks"]} for p in pools]


class PoolsConfig(TypedDict, total=False):
    """The program's config line (``control.warm.stop_pools``, ``launch.runner`` write it):
    none, the pools listed."""

    stop: bool
    """End this user's pools (``warm stop``) instead."""
    job: str
    """With ``stop``: only the pools kept for this job's restarts (none: the user's own)."""


def main() -> int:
    cfg: PoolsConfig = json.loads(sys.stdin.readline() or "{}")
    sys.stdout.buffer.write(hello("warm"))
    stopped = stop(str(cfg.get("job") or "")) if cfg.get("stop") else []
    answer: WarmAnswer = {"pools": [] if stopped else listed(), "stopped": stopped}
    sys.stdout.buffer.write(encode(Kind.RESULT, answer))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
