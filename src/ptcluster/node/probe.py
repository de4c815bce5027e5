"""The probe of a lost node: the head asks it once more, briefly, what became of it.

Standard library only (shipped like the others). It answers one frame and ends: the node's boot
(its boot id and uptime: another boot id than its guard reported at ready means it rebooted),
whether the job's guard still runs here (by its pid, checked to be that job's guard), and after a
reboot the previous boot's last kernel lines where the journal keeps them and lets us read them
(``journalctl -k -b -1``: root or group ``adm``/``systemd-journal``), bounded in time. Given
``health`` (``run --readmit``: a node that answers again is taken back only when fit), also the
health gate's refusal (``unfit``: None when the node would pass the gate a guard runs).

  stdin  line 2  JSON config (``ProbeConfig``): {"job_id", "guard_pid", "boot_id", "health"}
                 (the middle two from ready; ``health``: the gate's context,
                 ``node.facts.health.health``)
  stdout         frames of ``node.wire``: ``hello``, then ``boot {json}``
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import TypedDict

from ptcluster.node.facts.health import Unfit, health, unfit
from ptcluster.node.facts.health_facts import HealthContext, boot
from ptcluster.node.wire import Kind, encode, hello

KERNEL_LINES = 8
"""The previous boot's last kernel lines the probe sends (its last words: a panic, an Xid)."""
JOURNAL_TIMEOUT = 1.5
"""Seconds ``journalctl`` may take (the head waits a few seconds for the whole answer)."""


def guard_runs(pid: int, job_id: str) -> bool:
    """Whether ``pid`` is the guard of ``job_id`` (its command line ends ``guard JOB_ID``: the
    bootstrap's, ``remote.bootstrap.node_argv``), not a process that took over its pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(1 << 16).rstrip(b"\0").split(b"\0")
    except OSError:
        return False
    return argv[-2:] == [b"guard", job_id.encode()]


def previous_kernel() -> list[str]:
    """The previous boot's last kernel lines, where the journal keeps them; [] otherwise."""
    try:
        out = subprocess.run(["journalctl", "-k", "-b", "-1", "-n", str(KERNEL_LINES),
                              "--no-pager", "-q", "-o", "short-iso"],
                             capture_output=True, text=True, timeout=JOURNAL_TIMEOUT,
                             stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [line[:300] for line in out.stdout.splitlines()[-KERNEL_LINES:]]


class BootAnswer(TypedDict, total=False):
    """The probe's ``boot`` frame (:func:`answer`), checked by the head as it arrives
    (``remote.node_replies.BOOT``: the same keys)."""

    boot_id: str | None
    """This boot's id (``/proc/sys/kernel/random/boot_id``)."""
    uptime: float | None
    time: float
    """The node's clock when it answered."""
    guard_alive: bool | None
    """Whether the job's guard still runs here (None: the head named no guard)."""
    kernel: list[str]
    """After a reboot: the previous boot's last kernel lines (only then)."""
    unfit: Unfit | None
    """Only when the head sent the gate's context: its refusal, None when fit."""


class _Config(TypedDict):
    job_id: str


class ProbeConfig(_Config, total=False):
    """The probe's config line (``launch.lost.probe`` writes it)."""

    guard_pid: int | None
    """The job's guard here, as its ready frame said (None: none to look for)."""
    boot_id: str | None
    """This node's boot id at ready (another one now: it rebooted)."""
    health: HealthContext
    """The health gate's context: answer its verdict too (``unfit``)."""


def answer(cfg: ProbeConfig) -> BootAnswer:
    now = boot()
    out: BootAnswer = {"boot_id": now.get("boot_id"), "uptime": now.get("uptime"),
                       "time": time.time()}
    pid = cfg.get("guard_pid")
    out["guard_alive"] = guard_runs(int(pid), str(cfg.get("job_id"))) if pid else None
    before = cfg.get("boot_id")
    if before and now.get("boot_id") and before != now["boot_id"]:
        out["kernel"] = previous_kernel()
    if isinstance(cfg.get("health"), dict):
        out["unfit"] = unfit(health(cfg["health"]))
    return out


def main() -> int:
    cfg: ProbeConfig = json.loads(sys.stdin.readline())
    sys.stdout.buffer.write(hello("probe"))
    sys.stdout.buffer.write(encode(Kind.BOOT, answer(cfg)))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
