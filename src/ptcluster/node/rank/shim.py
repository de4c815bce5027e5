"""Every rank's process under torchrun: a small parent around the user's program (stdlib only).

torchrun starts ``python -u -c SHIM_BOOT (-m MODULE | SCRIPT | -c CODE) ARGS``: SHIM_BOOT runs
the file the guard wrote this program to (its path in ``rank_wire.SHIM_VAR``; shipped with the
rank protocol, ``node.rank_wire``, and the stack probe). This code connects to its node's guard
(``SOCK_VAR``) and starts the target in a child, ``python -u -c SHIM_BOOT --ptcluster-child
TARGET...``, which runs it the way ``python`` would (``run_in_process``), with its stdout and
stderr going straight into the guard's socket.
The parent forwards signals, waits, and reports the exit status as the kernel gave it: an exit
code, ``os._exit(0)``, or the signal that killed it. The child reports the moment an exception
leaves the user's code (a rank that raises and then hangs in its cleanup failed when it raised,
not when the teardown killed it), and the moment the user's code returned (a rank killed in
the interpreter's shutdown after that had finished its work). No log format is parsed anywhere.

The target runs in its own process group (torchrun signals the shim's group: the shim forwards
once). PR_SET_PDEATHSIG ties the child to the shim and the shim to torchrun, so a SIGKILL
anywhere above a rank leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from types import TracebackType

from ptcluster.node.rank.stack_probe import install as install_probe
from ptcluster.node.rank.step_probe import install as install_step_probe
from ptcluster.node.rank_wire import (
    CHILD_FLAG,
    CTL,
    DATA,
    ELASTIC_VARS,
    ERR,
    ERROR,
    EXIT,
    FORWARDED,
    OUT,
    PREDICT_VAR,
    REPORT,
    RETURNED,
    SHIM_BOOT,
    SHIM_VAR,
    SOCK_VAR,
    START,
    RankError,
    RankExit,
    RankStart,
    connect_or_none,
    send_record,
)

PR_SET_PDEATHSIG = 1




def _prctl() -> object:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def run_target(argv: list[str]) -> int:
    """Run the target, report start and exit to the guard; the target's wait status."""
    rank = int(os.environ.get("RANK", "-1"))
    prctl = _prctl()
    if callable(prctl):
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with torchrun
    path = os.environ.get(SOCK_VAR, "")
    ctl = connect_or_none(path, rank, CTL) if path else None
    out = connect_or_none(path, rank, OUT) if ctl else None
    err = connect_or_none(path, rank, ERR) if ctl else None
    parent = os.getpid()
    # torchrun sets its own restart count (always 0: ptcluster restarts the whole job); a rank
    # sees the job's attempt instead, as torch's elastic scripts expect it.
    for ours, theirs in ELASTIC_VARS:
        if ours in os.environ:
            os.environ[theirs] = os.environ[ours]

    def child_setup() -> None:
        os.setpgid(0, 0)
        if callable(prctl):
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the shim died before the line above: do not run orphaned
            os._exit(137)

    start = time.time()
    head = ["-c", SHIM_BOOT, CHILD_FLAG] if SHIM_VAR in os.environ else \
        [os.path.abspath(__file__), CHILD_FLAG]
    child = subprocess.Popen(
        [sys.executable, "-u", *head, *argv], preexec_fn=child_setup,
        stdout=out.fileno() if out else None, stderr=err.fileno() if err else None,
    )
    for s in (out, err):
        if s is not None:
            s.close()  # the target holds them now: EOF comes when it (and its children) end
    started: RankStart = {"pid": child.pid, "shim_pid": parent, "t": start,
                          "streams": int(out is not None) + int(err is not None),
                          "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
                          "python": sys.executable}
    send_record(ctl, START, started)

    def forward(signum: int, frame: object) -> None:
        try:
            child.send_signal(signum)  # a no-op once the child is reaped (no pid reuse)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = child.wait()
    end = time.time()
    ended: RankExit = {"code": code, "t": end, "duration": round(end - start, 3)}
    send_record(ctl, EXIT, ended)
    if ctl is not None:
        ctl.close()
    return code


def run_in_process(argv: list[str]) -> None:
    """In the child: run ``(-m MODULE | -c CODE | SCRIPT) ARGS`` as ``python`` would; when an
    exception leaves it, tell the guard when and what, then let it end the process as usual;
    when it returns (or exits 0), say so too: the rest is the interpreter's shutdown."""
    _install_probe()
    if os.environ.get(PREDICT_VAR):  # bench --predict: its step probe, before the program
        install_step_probe(os.environ[PREDICT_VAR], lambda body: _report(REPORT, body))
    try:
        # (SHIM_BOOT took "" off sys.path: the user's program gets its
        # own first entry back, as python gives it; ptcluster's own -c programs none)
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":  # (only ptcluster's own: doctor's and bench's rank programs)
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = [p for p in sys.path if os.path.abspath(p) != os.getcwd()]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code in (None, 0):
            _report(REPORT, {"kind": RETURNED, "t": time.time()})
        else:
            _report_error(exc, f"SystemExit: {exc.code}")
        raise
    except KeyboardInterrupt as exc:
        _report_error(exc, "KeyboardInterrupt")
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, then shown as python shows it
        _report_error(exc, f"{type(exc).__name__}: {exc}"[:300])
        # The traceback as `python` would print it: from the user's code down, without our
        # frames and runpy's (sys.excepthook: torch's rank prefix applies as usual).
        exc.__traceback__ = _user_frames(exc.__traceback__)  # (what the hook prints)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None
    # The program is done; what follows is the interpreter's shutdown. Said now, so that a
    # process that dies in it (a library's exit-time abort) is reported as what it is.
    _report(REPORT, {"kind": RETURNED, "t": time.time()})


def _install_probe() -> None:
    """The stack probe (``stack_probe.py``): every thread's stack when the guard asks, without
    the script's help. Never in the way of the target: any trouble leaves the rank without it."""
    path = os.environ.get(SOCK_VAR, "")
    if not path:
        return
    try:
        install_probe(path, int(os.environ.get("RANK", "-1")))
    except Exception:  # noqa: BLE001, S110 - see above
        pass


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    first = tb
    while tb is not None and tb.tb_frame.f_code is not run_in_process.__code__:
        tb = tb.tb_next
    if tb is None:
        return first
    tb = tb.tb_next
    while tb is not None and "runpy" in tb.tb_frame.f_code.co_filename:
        tb = tb.tb_next
    return tb or first


def _report_error(exc: BaseException, text: str) -> None:
    _report(ERROR, error_record(exc, text))


def error_record(exc: BaseException, text: str) -> RankError:
    """The ``error`` record of ``exc`` (``rank_wire.ERROR``): its type's name and ``text``; the
    errno and file of the first ``OSError`` in its chain, and argparse's message when the
    parser ended the program."""
    body: RankError = {"t": time.time(), "exc": type(exc).__name__, "text": text}
    body.update(_os_error(exc))
    usage = _argparse_message(exc)
    if usage:
        body["usage"] = usage
    return body


def _os_error(exc: BaseException) -> RankError:
    """``{errno, filename}`` of the first ``OSError`` in the exception's chain (torch wraps a
    full disk's ``OSError`` in its ``RuntimeError``); the file as an absolute path."""
    seen: list[BaseException] = []
    at: BaseException | None = exc
    while at is not None and len(seen) < 8 and not any(at is s for s in seen):
        if isinstance(at, OSError) and at.errno:
            name = at.filename if isinstance(at.filename, str) else ""
            return {"errno": at.errno, "filename": os.path.abspath(name) if name else ""}
        seen.append(at)
        at = at.__cause__ or at.__context__
    return {}


def _argparse_message(exc: BaseException) -> str:
    """What ``argparse`` exited with when the parser ended the program (``parser.error``): the
    ``message`` of its frame on the exception's traceback, not the text it printed."""
    parser = getattr(sys.modules.get("argparse"), "ArgumentParser", None)
    code = getattr(getattr(parser, "error", None), "__code__", None)
    tb = exc.__traceback__ if isinstance(exc, SystemExit) and code is not None else None
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return str(tb.tb_frame.f_locals.get("message", ""))[:300]
        tb = tb.tb_next
    return ""


def _report(kind: str, body: Mapping[str, object]) -> None:
    """One record to the guard on a connection of its own (the child has no ``ctl``)."""
    rank = int(os.environ.get("RANK", "-1"))
    path = os.environ.get(SOCK_VAR, "")
    s = connect_or_none(path, rank, DATA) if path else None
    send_record(s, kind, body)
    if s is not None:
        s.close()


def exit_like(code: int) -> None:
    """End this process the way the target ended, so torchrun sees the same status."""
    if code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        code = 128 - code
    sys.exit(code)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD_FLAG:
        run_in_process(sys.argv[2:])
    else:
        exit_like(run_target(sys.argv[1:]))


if __name__ == "__main__":
    main()
