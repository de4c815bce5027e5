"""The rank's stack probe: installed by the shim in the rank's process before the user's code.

Standard library only (it runs in every rank, shipped with the shim, and imports
torch only when the user's program already did). Two things:

* a ``probe`` connection to the guard's socket, served by a daemon thread (below), which
  answers ``dump`` with every thread's stack from ``sys._current_frames()``: under the GIL, so
  safe while the program runs.
* a file in the guard's private temp dir (next to its socket), the target of
  ``faulthandler.register(STACK_SIGNAL, all_threads=True)``: the fallback when the thread cannot
  answer because a thread holds the GIL in C code. The C handler needs no GIL and no help from
  the script; it reads the frames of every thread without a lock, which is safe only when no
  thread runs Python at that moment (a held GIL guarantees it; a healthy job does not: a dump
  by signal while the job ran crashed a rank with SIGSEGV in 2 of 7 tries here, hence the
  thread first). A file, not a socket: faulthandler writes in many tiny pieces, which fill a
  socket's buffer after a few hundred of them, and the rank would then wait in its signal
  handler for the guard to read; a file never makes it wait.

The thread says ``ready`` (with this process's pid and the dump file: the guard signals only a
process whose handler is installed; the default action of a real-time signal is to terminate).
When torch.distributed is initialized and its flight recorder is on (``TORCH_FR_BUFFER_SIZE``),
it reports the collectives enqueued and completed whenever they change (the guard's progress
measure) and adds the collectives in flight to its ``dump`` answer.
"""

import atexit
import faulthandler
import json
import os
import socket
import sys
import threading
import types

from ptcluster.node.rank_wire import (
    DUMP,
    FR_VAR,
    PROBE,
    PROGRESS,
    READY,
    STACK_SIGNAL,
    ProbeDump,
    ProbeProgress,
    ProbeReady,
    connect,
    encode_record,
)

POLL = 1.0
"""Seconds between two looks at the flight recorder's counters (a cheap call: no entries)."""
_torch_calls = threading.Lock()
"""Held while this thread is inside torch; taken for good when the interpreter exits, so the
thread is never inside torch's C++ while the process tears it down (a daemon thread otherwise
runs on into exit)."""


def _stop_torch_calls() -> None:
    _torch_calls.acquire(timeout=5)

_keep: list = []  # the sockets live as long as the process (faulthandler holds the fd)


def install(path: str, rank: int) -> None:
    """Connect to the guard and install the handler; silently nothing when that fails (the
    probe must never keep a rank from running)."""
    stk_path = os.path.join(os.path.dirname(path), f"stk-{rank}-{os.getpid()}")
    try:
        stk = open(stk_path, "ab", buffering=0)
        probe = connect(path, rank, PROBE)
    except OSError:
        return
    faulthandler.register(STACK_SIGNAL, file=stk, all_threads=True, chain=False)
    atexit.register(_stop_torch_calls)
    _keep.extend((stk, probe))
    ready: ProbeReady = {"pid": os.getpid(), "signal": int(STACK_SIGNAL),
                         "fr": _fr_buffer() > 0, "stk": stk_path}
    probe.sendall(encode_record(READY, ready))
    threading.Thread(target=_serve, args=(probe,), name="ptcluster-stack-probe",
                     daemon=True).start()


def _fr_buffer() -> int:
    try:
        return int(os.environ.get(FR_VAR, "0"))
    except ValueError:
        return 0


def _serve(s: socket.socket) -> None:
    s.settimeout(POLL)
    buf = b""
    last = None
    while True:
        try:
            data = s.recv(4096)
            if not data:
                return  # the guard is gone
            buf += data
        except TimeoutError:
            pass
        except OSError:
            return
        try:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip() == DUMP.encode():
                    dump: ProbeDump = {"text": stacks_text(),
                                       "fr": flight_recorder(active=True)}
                    s.sendall(encode_record(DUMP, dump))
            counts = flight_recorder(active=False).get("counts")
            if counts is not None and counts != last:
                last = counts
                s.sendall(encode_record(PROGRESS, counts))
        except OSError:
            return


def stacks_text() -> str:
    """Every other thread's stack, from ``sys._current_frames()`` under the GIL, in
    faulthandler's format (one parser for both). Safe while threads run, unlike faulthandler's
    handler, which reads the frames of threads that may be running at that very moment."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, top in sys._current_frames().items():
        if ident == me:
            continue
        frame: types.FrameType | None = top
        out.append(f"Thread 0x{ident:016x} [{names.get(ident, '')}] (most recent call first):")
        while frame is not None:
            code = frame.f_code
            out.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
            frame = frame.f_back
        out.append("")
    return "\n".join(out)


def flight_recorder(active: bool) -> dict:
    """The flight recorder's state: per process group the last collective enqueued and the
    last completed (``counts``), and with ``active`` the collectives in flight. Empty when the
    program has no initialized process group or the recorder is off."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or _fr_buffer() <= 0 or not _torch_calls.acquire(blocking=False):
        return {}  # (not taken: the process is exiting)
    try:
        if not dist.is_initialized():
            return {}
        c10d = sys.modules["torch"]._C._distributed_c10d
        # counters only: no entries (cheap, every POLL s); on a request: every entry
        raw = json.loads(c10d._dump_fr_trace_json(active, not active))
    except Exception as exc:  # noqa: BLE001 - a torch without it, or a recorder error
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    finally:
        _torch_calls.release()
    status = raw.get("pg_status") or {}
    enq = comp = 0
    waiting = []
    for pg, st in status.items():
        e, c = int(st.get("last_enqueued_collective", -1)), int(st.get("last_completed_collective",
                                                                       -1))
        enq, comp = enq + max(e, 0), comp + max(c, 0)
        if e > c:
            waiting.append(pg)
    counts: ProbeProgress = {"enqueued": enq, "completed": comp, "waiting": waiting}
    out: dict = {"counts": counts}
    if active:
        entries = raw.get("entries") or []
        out["active"] = [{"pg": (e.get("process_group") or ["?"])[-1],
                          "seq": e.get("collective_seq_id"), "op": e.get("profiling_name"),
                          "sizes": e.get("input_sizes"), "state": e.get("state")}
                         for e in entries if not e.get("retired")][-8:]
        if len(entries) < _fr_buffer():  # the whole history: a desync shows in the counts
            ops: dict = {}
            for e in entries:
                name = str(e.get("profiling_name"))
                ops[name] = ops.get(name, 0) + 1
            out["ops"] = ops
    return out
