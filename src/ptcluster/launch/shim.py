"""Every rank's process under torchrun: a small parent around the user's program (stdlib only).

torchrun starts ``python -u -c 'exec(os.environ[SHIM_VAR])' (-m MODULE | SCRIPT | -c CODE)
ARGS``. This code connects to its node's guard (``PTCLUSTER_GUARD_SOCK``), starts the target as
``python -u (-m MODULE | SCRIPT | -c CODE) ARGS`` — exactly what ``python`` would run — with its
stdout and stderr going straight into the guard's socket, forwards signals to it, waits for it
and reports its exit status as the kernel gave it: an exit code, ``os._exit(0)``, or the signal
that killed it. No log format is parsed anywhere, so any torchrun log setting is fine.

The target runs in its own process group (torchrun signals the shim's group: the shim forwards
once) and dies with the shim (PR_SET_PDEATHSIG), so a SIGKILL of the shim leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time

GUARD_SOCK = "PTCLUSTER_GUARD_SOCK"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def _connect(path: str, rank: int, role: str) -> socket.socket | None:
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(json.dumps({"rank": rank, "role": role}).encode() + b"\n")
        return s
    except OSError:
        return None


def _send(ctl: socket.socket | None, kind: str, body: dict[str, object]) -> None:
    if ctl is None:
        return
    try:
        ctl.sendall(f"{kind} {json.dumps(body)}\n".encode())
    except OSError:
        pass


def run_target(argv: list[str]) -> int:
    """Run the target, report start and exit to the guard; the target's wait status."""
    rank = int(os.environ.get("RANK", "-1"))
    path = os.environ.get(GUARD_SOCK, "")
    ctl = _connect(path, rank, "ctl") if path else None
    out = _connect(path, rank, "out") if ctl else None
    err = _connect(path, rank, "err") if ctl else None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None
    parent = os.getpid()

    def child_setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the shim died before the line above: do not run orphaned
            os._exit(137)

    start = time.time()
    child = subprocess.Popen(
        [sys.executable, "-u", *argv], preexec_fn=child_setup,
        stdout=out.fileno() if out else None, stderr=err.fileno() if err else None,
    )
    for s in (out, err):
        if s is not None:
            s.close()  # the target holds them now: EOF comes when it (and its children) end
    _send(ctl, "start", {"pid": child.pid, "shim_pid": parent, "t": start,
                         "local_rank": int(os.environ.get("LOCAL_RANK", "-1"))})

    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = child.wait()
    end = time.time()
    _send(ctl, "exit", {"code": code, "t": end, "duration": round(end - start, 3)})
    if ctl is not None:
        ctl.close()
    return code


def exit_like(code: int) -> None:
    """End this process the way the target ended, so torchrun sees the same status."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        code = 128 - code
    sys.exit(code)


if __name__ == "__main__":
    exit_like(run_target(sys.argv[1:]))
