"""The rank<->guard boundary: how a rank's processes talk to their node's guard.

Standard library only; shipped with every end that uses it: inlined into the guard (its rank
server and hang watch), packed into the shim and the stack probe the guard hands its ranks, and
prefixed to the rank programs (``node/rank/api.py``). One module, so both ends agree on it.

A rank connects to the guard's Unix socket (its path in ``SOCK_VAR``), once per role, and starts
every connection with one JSON header line ``{"rank": R, "role": ROLE}``:

* ``out`` / ``err``: the rank's raw stdout / stderr (never parsed);
* ``ctl``: the shim's ``start`` and ``exit`` records (the process facts the kernel gave);
* ``data``: what the rank's own code reports: ``error`` when an exception left the user's code,
  ``data`` records (``returned``, ``checkpoint``, ``resumed``, and a rank program's results);
* ``probe``: the stack probe's connection (``ready``, ``progress``, ``stacks`` answers).

A record is one line, ``KIND JSON`` (a JSON object). The guard passes a rank's records to the head
as ``node.wire`` frames (``RANK_FRAMES`` there).
"""

import json
import signal
import socket

SOCK_VAR = "PTCLUSTER_GUARD_SOCK"
"""Env var of every rank: the path of its guard's Unix socket."""
SHIM_VAR = "PTCLUSTER_SHIM"
"""Env var of every rank: the path of the shim the guard wrote into its private temp dir (the
stack probe is its neighbour). A path, not code: a rank's environment carries configuration."""
SHIM_BOOT = (f"import os;f=open(os.environ[{SHIM_VAR!r}]);s=f.read();f.close();"
             "exec(compile(s,'ptcluster-shim','exec'))")
"""The code torchrun runs for every rank (``-c``): the shim, from the file the guard wrote."""
SHIM_FILE, PROBE_FILE = "shim.py", "stack_probe.py"
"""Their names in that dir (the packer names a handed program by its module's file)."""
STACK_SIGNAL = signal.SIGRTMIN + 7
"""The guard's "dump your stacks" signal, answered by the probe's faulthandler (glibc keeps
SIGRTMIN-2..-1 for itself; +7 is free of torch and Python)."""

OUT, ERR, CTL, DATA, PROBE = "out", "err", "ctl", "data", "probe"
"""Connection roles."""
STREAMS = (OUT, ERR)

START, EXIT = "start", "exit"
"""Records on ``ctl``: the target's process started (pid, streams it opened), and ended (its wait
status: an exit code, or minus the signal that killed it)."""
ERROR = "error"
"""Record on ``data``: an exception left the user's code: ``{t, exc, text}``; ``exc`` is the
exception's type name (``SystemExit`` with a non-zero code, ``KeyboardInterrupt``, ...)."""
REPORT = "data"
"""Record on ``data``: ``{kind, ...}``, one of the kinds below or a rank program's own."""
RETURNED, CHECKPOINT, RESUMED = "returned", "checkpoint", "resumed"
"""Report kinds: the user's code returned (the rest is the interpreter's shutdown); a checkpoint
of ``step`` is complete; this attempt starts from ``step``."""
BAD_RECORD = "bad-record"
"""Report kind the guard makes of a line that is not a record."""
PROGRESS_REPORTS = (RETURNED, CHECKPOINT, RESUMED)
"""Report kinds that are about the job's life (the supervisor's), not a program's results."""
READY, PROGRESS, DUMP = "ready", "progress", "dump"
"""On ``probe``: the probe's ``ready {pid, signal, fr, stk}`` (its handler is installed: only then
may the guard signal it), ``progress {enqueued, completed, waiting}`` (the flight recorder's
counters, when they change), and ``dump {text, fr}``, its answer to the guard's ``dump`` line."""


def connect(path: str, rank: int, role: str) -> socket.socket:
    """A connection to the guard for ``role``, its header sent. Raises ``OSError``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.sendall(json.dumps({"rank": rank, "role": role}).encode() + b"\n")
    except OSError:
        s.close()
        raise
    return s


def header(line: bytes) -> tuple[int, str]:
    """``(rank, role)`` of a connection's first line. Raises ``ValueError``."""
    try:
        info = json.loads(line)
        return int(info["rank"]), str(info["role"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad header {line[:80]!r}") from exc


def encode_record(kind: str, body: dict) -> bytes:
    return f"{kind} {json.dumps(body)}\n".encode()


def decode_record(line: str) -> tuple[str, dict] | None:
    """``(kind, body)`` of one record line; None when it is not a record."""
    kind, _, payload = line.partition(" ")
    try:
        body = json.loads(payload) if payload else {}
    except ValueError:
        return None
    return (kind, body) if isinstance(body, dict) else None
