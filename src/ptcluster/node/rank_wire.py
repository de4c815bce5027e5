"""The rank<->guard boundary: how a rank's processes talk to their node's guard.

Standard library only; shipped with every end that uses it: the guard (its rank server and hang
watch), the shim and the stack probe the guard hands its ranks, and the rank programs
(``node/rank/api.py``). One module, so both ends agree on it.

A rank connects to the guard's Unix socket (its path in ``SOCK_VAR``), once per role, and starts
every connection with one JSON header line ``{"rank": R, "role": ROLE}``:

* ``out`` / ``err``: the rank's raw stdout / stderr (never parsed);
* ``ctl``: the shim's ``start`` and ``exit`` records (the process facts the kernel gave);
* ``data``: what the rank's own code reports: ``error`` when an exception left the user's code,
  ``data`` records (``returned``, ``checkpoint``, ``resumed``, and a rank program's results);
* ``probe``: the stack probe's connection (``ready``, ``progress``, ``stacks`` answers).

A record is one line, ``KIND JSON`` (a JSON object). The guard passes a rank's records to the head
as ``node.wire`` frames (``RANK_FRAMES`` there).

It also names every variable ptcluster puts in a rank's environment (the ``*_VAR`` constants
below): the head sets the job's (``launch.plan.node_env``), the guard adds the node's (its
``start``), the shim maps two onto torch's names, and the rank's own code reads them (the stack
probe, ``node.rank.api``, the reference trainer). Besides these a rank sees torchrun's (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) and the cluster file's ``env:``.
"""

import json
import signal
import socket
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

SOCK_VAR = "PTCLUSTER_GUARD_SOCK"
"""Env var of every rank: the path of its guard's Unix socket."""
SHIM_VAR = "PTCLUSTER_SHIM"
"""Env var of every rank: the path of the shim the guard wrote into its private temp dir (the
stack probe is its neighbour). A path, not code: a rank's environment carries configuration."""
NO_DOT = "import sys,os;sys.path[:]=[p for p in sys.path if p not in('','.')];"
"""First in every ``-c`` program ptcluster starts in a rank's working directory (by default the
head's: a cloned repository): ``-c`` puts the current directory first on ``sys.path``, and its
``json.py`` or ``torch/`` would be imported instead (review M3; node programs:
``remote.bootstrap``). ``os`` and ``sys`` are loaded before ``sys.path`` is read."""
NO_CWD = NO_DOT[:-2] + "and os.path.abspath(p)!=os.getcwd()];"
"""``NO_DOT``, and the working directory by any spelling (a ``PYTHONPATH`` entry): for
ptcluster's own programs (torchrun's agent; doctor's and bench's ranks: ``node.rank.shim``)."""
SHIM_BOOT = (NO_DOT + f"f=open(os.environ[{SHIM_VAR!r}]);s=f.read();f.close();"
             "exec(compile(s,'ptcluster-shim','exec'))")
"""The code torchrun runs for every rank (``-c``): the shim, from the file the guard wrote (it
puts back what the user's program expects, as python would: ``node.rank.shim.run_in_process``;
a user's own ``PYTHONPATH`` stays)."""
CHILD_FLAG = "--ptcluster-child"
"""``SHIM_BOOT --ptcluster-child TARGET...``: the shim's child part, which runs the target (the
shim starts it so; a warm pool's rank runs it the same way: ``node.warm.pool``)."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
"""What the shim forwards to its child (so a cold rank starts with them at their default)."""
SHIM_FILE, AGENT_FILE = "shim.py", "torchrun_agent.py"
"""The shim's name in that dir (the packer names a handed program by its module's file; the
stack probe travels in it), and that of torchrun's agent program
(``node/rank/torchrun_agent.py``), which the guard runs too."""
AGENT_BOOT = (NO_CWD + "p=sys.argv.pop(1);f=open(p);s=f.read();f.close();"
              "exec(compile(s,'ptcluster-torchrun','exec'))")
"""``python -c AGENT_BOOT PATH TORCHRUN_ARGS``: the agent program from the file the guard wrote
(its path the first argument, taken off before torchrun parses the rest)."""

# -- the environment of every rank: what ptcluster sets, who reads it ---------------------
JOB_VAR = "PTCLUSTER_JOB_ID"
"""The job's id, the same on every node and in every attempt: a checkpoint that records it is
this job's own (the reference trainer resumes a restart only from those)."""
ATTEMPT_VAR = "PTCLUSTER_ATTEMPT"
"""The attempt of the job, 0 first (every restart of ``--max-restarts`` adds one); the shim
also gives it to the rank as ``TORCHELASTIC_RESTART_COUNT``."""
MAX_RESTARTS_VAR = "PTCLUSTER_MAX_RESTARTS"
"""``--max-restarts``; the rank also sees it as ``TORCHELASTIC_MAX_RESTARTS``."""
RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"
"""torch's name for the attempt: what a rank program reads for "am I a restart?", so that it
means the same under a bare torchrun (the reference trainer does)."""
ELASTIC_VARS = ((ATTEMPT_VAR, RESTART_COUNT_VAR), (MAX_RESTARTS_VAR, "TORCHELASTIC_MAX_RESTARTS"))
"""(ours, torch's): torchrun sets its own restart count (always 0: ptcluster restarts the whole
job, not torchrun); the shim overwrites torch's with ours, as torch's elastic scripts expect."""
PREDICT_VAR = "PTCLUSTER_PREDICT"
"""Set only by ``bench --predict`` for its brief run: JSON (``warmup``, ``steps``) that arms
the step probe in every rank (``node.rank.step_probe``), which ends the job after those steps."""
BACKEND_VAR = "PTCLUSTER_BACKEND"
"""The cluster file's ``backend``: ``nccl``, ``gloo``, or ``auto`` (NCCL where the rank has a GPU,
else gloo; ``node.rank.api.init_distributed``)."""
TIMING_OFF_VAR = "PTCLUSTER_STRAGGLER"
"""``PTCLUSTER_STRAGGLER: "0"`` in the cluster file's ``env:`` turns the guard's ``timing`` frames
off (no straggler report; ``benchmarks/straggler_cost.py`` measures what they cost). The ranks
see it too, but it is the guard's knob."""
FR_VAR = "TORCH_FR_BUFFER_SIZE"
"""torch's flight recorder keeps this many collectives per rank (0: off): the hang report and
the progress measure read it (``node/rank/stack_probe.py``)."""
FR_DEFAULT = "2000"
"""What the plan sets when the cluster file's ``env:`` has no value of its own."""
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
"""The interface NCCL and gloo open their sockets on: the node's ``interface`` of the cluster
file (the plan), else the one the guard finds routes to the master (unless ``env:`` has them)."""
THREADS_VAR, THREADS_DEFAULT = "OMP_NUM_THREADS", "1"
"""Every rank's intra-op threads where its node has no value, in a job of several ranks (the
same on every rank: ``launch.plan.threads_default`` says why)."""
ACCELERATE_CPU = ("ACCELERATE_USE_CPU", "true")
"""Set by the guard for the ranks of a gloo job (``BACKEND_VAR`` gloo, or auto) on a node
without a GPU, unless the ranks' environment has it: Hugging Face Accelerate >= 1.16 otherwise
sees one process in a CPU job's every rank (``state.num_processes`` is 1, its own test script
fails), under plain torchrun too."""
TORCHRUN_LOG_VAR = "PET_LOG_DIR"
"""torchrun's own files: the guard points it into its private temp dir (removed with it)."""
AGENT_ERROR_VAR, AGENT_ERROR_FILE = "TORCHELASTIC_ERROR_FILE", "torchrun-error.json"
"""Where torchrun's ``@record`` writes the exception that ended it, as JSON (torch elastic's
``ErrorHandler``: ``{"message": {"message": "TYPE: TEXT", ...}}``): a file in the guard's temp
dir, read when torchrun fails with no rank failed (its rendezvous). Each rank gets its own path
from torchrun instead."""

DATA_VAR = "PTCLUSTER_DATA"
"""Every rank: the folder of the first ``data:`` entry (or ``run --data``) on its node."""
DATA_VAR_PREFIX = "PTCLUSTER_DATA_"
"""Every rank: ``PTCLUSTER_DATA_<NAME>``, each entry's folder on its node."""
CKPT_ROOT_VAR = "PTCLUSTER_CKPT_ROOT"
"""Where ``ptcluster.checkpoint`` puts a relative ``dir`` on this node (default: the rank's
working directory, the workdir). Nobody sets it for a job; a user may (a node's local scratch
disk), and the tests give each simulated node its own so that nothing is shared by accident."""

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
"""Record on ``data``: an exception left the user's code: ``{t, exc, text, errno?, filename?,
usage?}``; ``exc`` is the exception's type name (``SystemExit`` with a non-zero code,
``KeyboardInterrupt``, ...); ``errno`` and ``filename`` those of the first ``OSError`` in its
chain, where one is (the file as an absolute path; "" when the error named none); ``usage``
argparse's message, when the parser ended the program."""
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


class RankStart(TypedDict, total=False):
    """``start`` on ``ctl``: the target's process started (``node.rank.shim``; a warm rank's:
    ``guard.warm_ranks``)."""

    pid: int
    shim_pid: int
    t: float
    streams: int
    """The output streams it opened (the guard sends its exit once they are closed)."""
    local_rank: int
    python: str
    rank: int
    """The connection's rank: the guard's, as it passes any record on."""


class RankExit(TypedDict, total=False):
    """``exit`` on ``ctl``: the target ended (the shim's; a warm rank's: ``guard.warm_ranks``;
    the guard's own where the shim died without one)."""

    code: int | None
    """Its wait status: an exit code, or minus the signal that killed it (None: unknown)."""
    t: float
    duration: float
    note: str
    """The guard's: why it made the record (``ended without an exit record``)."""
    rank: int
    oom: Mapping[str, object]
    xids: Sequence[Mapping[str, object]]
    """The guard's, on a failed rank: ``node.wire.OomFacts`` and ``XidFacts``."""


class RankError(TypedDict, total=False):
    """``error`` on ``data``: an exception left the user's code (``node.rank.shim.error_record``;
    a warm rank its pool failed: ``guard.warm_ranks``, a declared problem)."""

    t: float
    exc: str
    """The exception's type name."""
    text: str
    errno: int
    filename: str
    """Those of the first ``OSError`` in its chain (the file absolute; "": none named)."""
    usage: str
    """argparse's message, when the parser ended the program."""
    code: str
    fix: str
    fields: dict[str, str]
    """A declared problem's (``node.problems.Sent``)."""
    rank: int
    disk: Mapping[str, object]
    """The guard's, where the error says the disk was full: ``node.wire.DiskFacts``."""


class ProbeReady(TypedDict):
    """The stack probe's ``ready`` (``node.rank.stack_probe.install``)."""

    pid: int
    signal: int
    fr: bool
    """The flight recorder is on."""
    stk: str
    """The file faulthandler's dumps go to."""


class ProbeProgress(TypedDict):
    """The stack probe's ``progress``: the flight recorder's counters, summed over the process
    groups, when they change (``stack_probe.flight_recorder``'s ``counts``)."""

    enqueued: int
    completed: int
    waiting: list[str]
    """The groups with a collective enqueued and not completed."""


class ProbeDump(TypedDict, total=False):
    """The stack probe's ``dump``: its answer to the guard's ``dump`` line."""

    text: str
    fr: dict[str, object]
    """The flight recorder's state (``stack_probe.flight_recorder``: torch's JSON)."""
    at: float
    """The guard's: when it came (its monotonic clock)."""


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


def connect_or_none(path: str, rank: int, role: str) -> socket.socket | None:
    """:func:`connect`, or None where the guard cannot be reached (the caller goes on without
    it: a rank is never stopped by its reports)."""
    try:
        return connect(path, rank, role)
    except OSError:
        return None


def send_record(sock: socket.socket | None, kind: str, body: Mapping[str, object]) -> None:
    """One record on ``sock`` (None: nowhere); a guard gone meanwhile is not an error here."""
    if sock is None:
        return
    try:
        sock.sendall(encode_record(kind, body))
    except OSError:
        pass


def header(line: bytes) -> tuple[int, str]:
    """``(rank, role)`` of a connection's first line. Raises ``ValueError``."""
    try:
        info = json.loads(line)
        return int(info["rank"]), str(info["role"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad header {line[:80]!r}") from exc


def encode_record(kind: str, body: Mapping[str, object]) -> bytes:
    return f"{kind} {json.dumps(body)}\n".encode()


def decode_record(line: str) -> tuple[str, Any] | None:
    """``(kind, body)`` of one record line (a JSON object: the reader declares which record of
    ``kind`` it is); None when it is not a record."""
    kind, _, payload = line.partition(" ")
    try:
        body = json.loads(payload) if payload else {}
    except ValueError:
        return None
    return (kind, body) if isinstance(body, dict) else None
