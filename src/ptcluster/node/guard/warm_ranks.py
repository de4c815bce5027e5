"""Ranks from a warm pool: torchrun's agent part, done by the guard (``run --warm``;
ARCHITECTURE.md, "The warm path").

Standard library only; a part of the guard (shipped by ``remote.bootstrap``). For each of its
ranks the guard computes the variables torch 2.13's ``LocalElasticAgent._start_workers`` sets
(:func:`elastic_env`, over ``spawn.rank_env``: the cold path's own start), connects the rank's
``ctl``/``out``/``err`` to its rank server as the shim's parent does, asks the pool to fork it
(``warm.protocol``: the streams go by ``SCM_RIGHTS``) and sends the ``start`` and ``exit``
records the shim's parent would. :class:`WarmRanks` stands where torchrun's ``Popen`` stands in
the guard's life (``poll``, ``send_signal``; ``kill_all`` for the teardown: the ranks are the
pool's children, not the guard's).
"""

from __future__ import annotations

import os
import resource
import selectors
import signal
import socket
import sys
import threading
import time
from typing import TypedDict

from ptcluster.node.guard.proctree import descendants
from ptcluster.node.guard.warm_pool import WarmError
from ptcluster.node.problems import Declared, Sent
from ptcluster.node.rank_wire import (
    AGENT_ERROR_VAR,
    CHILD_FLAG,
    CTL,
    DATA,
    ELASTIC_VARS,
    ERR,
    ERROR,
    EXIT,
    FORWARDED,
    OUT,
    START,
    THREADS_VAR,
    RankError,
    RankExit,
    RankStart,
    connect_or_none,
    send_record,
)
from ptcluster.node.warm.pool import kill_session
from ptcluster.node.warm.protocol import FORK, PID, REFUSED, STATUS, Message, receive, send
from ptcluster.node.wire import GuardConfig

POOL_FIX = ("see the node log for what ended it; run again (a node whose pool does not answer "
            "starts its ranks cold)")
POOL_ENDED = Declared(
    "run.warm-pool-ended", "the warm pool ended while its ranks ran",
    "the warm pool on this node ended while this rank ran (killed?): the rank died with it",
    POOL_FIX)
POOL_NO_RANK = Declared(
    "run.warm-pool-no-rank", "the warm pool did not start a rank",
    "the warm pool did not start this rank: {why}", POOL_FIX)
TABLE = (POOL_ENDED, POOL_NO_RANK)
"""A rank of a warm pool that failed for the pool's sake, as its error record says it
(``Declared.sent`` beside ``exc`` ``WarmPoolLost``; the head's failure carries the code)."""

LOCAL_RANK_MACRO = "${local_rank}"
SIGNALS_VAR, SIGNALS_DEFAULT = "TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torchrun puts its ``--signals-to-handle`` (this default) into its own environment."""
FORK_WITHIN = 60.0
"""Seconds the pool has to answer a fork (it takes milliseconds; a stopped pool never does)."""
MONITOR_INTERVAL = 0.1
"""torchrun's ``--monitor-interval`` default: how soon after a worker's failure it stops the
others (a rank that ends within it ends as it would)."""
RUN_ID = "none"
"""torchrun's ``--rdzv-id`` default, which the plan keeps: every rank's TORCHELASTIC_RUN_ID."""


class TorchrunOptions(TypedDict):
    """What :func:`torchrun_options` reads of the plan's torchrun command."""

    nnodes: int
    node_rank: int
    nproc: int
    master_addr: str
    master_port: str
    target: list[str]
    """What follows ``-c SHIM_BOOT``: the rank's program and its arguments."""


def torchrun_options(argv: list[str]) -> TorchrunOptions:
    """What the plan's torchrun command says (``launch.plan.torchrun_argv``): the node's place
    and the program (``--no-python PYTHON -u -c SHIM_BOOT TARGET...``)."""
    at = argv.index("--no-python")
    opts = {argv[i][2:]: argv[i + 1] for i in range(3, at - 1) if argv[i].startswith("--")}
    return {"nnodes": int(opts["nnodes"]), "node_rank": int(opts["node-rank"]),
            "nproc": int(opts["nproc-per-node"]), "master_addr": opts["master-addr"],
            "master_port": opts["master-port"], "target": argv[at + 5:]}


def elastic_env(base: dict[str, str], opts: TorchrunOptions, local_rank: int, rank: int,
                world: int, error_file: str) -> dict[str, str]:
    """One rank's environment as torchrun would give it (its ``_start_workers``, its
    OMP_NUM_THREADS rule, the shim's restart count), but that no agent store serves it."""
    env = dict(base)
    if THREADS_VAR not in env and opts["nproc"] > 1:
        env[THREADS_VAR] = "1"
    env.update({
        "RANK": str(rank), "GROUP_RANK": str(opts["node_rank"]), "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(opts["nproc"]),
        "WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": str(opts["nnodes"]),
        "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": opts["master_addr"],
        "MASTER_PORT": str(opts["master_port"]),
        "TORCHELASTIC_RUN_ID": RUN_ID, "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "LOCAL_RANK": str(local_rank), AGENT_ERROR_VAR: error_file,
        **{theirs: base.get(ours, "0") for ours, theirs in ELASTIC_VARS},  # (the shim's map)
    })
    env[SIGNALS_VAR] = SIGNALS_DEFAULT  # (torchrun sets it in its own environment: launcher/api.py)
    return env


def cold_ignored() -> list[int]:
    """The signals a cold rank starts with ignored: the guard's inherited ignores that nothing
    on the way resets (torchrun's SIGINT, the shim's forwarded ones, Python's own)."""
    reset = {signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ, *FORWARDED}
    return [int(s) for s in signal.valid_signals()
            if s not in reset and _ignored(s)]


def _ignored(sig: int) -> bool:
    try:
        return signal.getsignal(sig) == signal.SIG_IGN
    except (OSError, ValueError):
        return False


def umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def rlimits() -> dict[str, list[int]]:
    return {name: list(resource.getrlimit(getattr(resource, name))) for name in dir(resource)
            if name.startswith("RLIMIT_") and isinstance(getattr(resource, name), int)}


def cgroup_files() -> list[list[str]]:
    """[line of ``/proc/self/cgroup``, its group's ``cgroup.procs``] for each hierarchy mounted
    here: where a cold rank would be (its memory limit, its OOM counts, Slurm's accounting)."""
    from ptcluster.node.guard.disk import mounts
    points: dict[str, str] = {}
    for point, fstype, _ in mounts():
        if fstype == "cgroup2":
            points.setdefault("", point)
        elif fstype == "cgroup":
            for part in os.path.basename(point).split(","):
                points.setdefault(part, point)
    out = []
    with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
            first = controllers.split(",")[0].removeprefix("name=")
            if first in points:
                out.append([line, os.path.join(points[first] + path, "cgroup.procs")])
    return out


class Pooled:
    """One pooled rank as the guard sees it."""

    def __init__(self, rank: int, conn: socket.socket, ctl: socket.socket | None,
                 pid: int, pidfd: int) -> None:
        self.rank, self.conn, self.ctl, self.pid, self.pidfd = rank, conn, ctl, pid, pidfd
        self.code: int | None = None
        self.started = time.time()


def pool_error(problem: Sent) -> RankError:
    """A rank's ``error`` record of what its pool did (``problem``: declared, as sent)."""
    return {"t": time.time(), "exc": "WarmPoolLost", "text": problem["what"],
            "fix": problem["fix"], "code": problem["code"], "fields": problem["fields"]}


class WarmRanks:
    """This node's ranks, forked by the pool at ``sock``; ``poll`` is torchrun's exit status."""

    def __init__(self, sock: str, server: str) -> None:
        self.sock, self.server = sock, server
        self.pid = os.getpid()
        self.ranks: list[Pooled] = []
        self.lock = threading.Lock()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self.sel = selectors.DefaultSelector()

    def start(self, cfg: GuardConfig, env: dict[str, str], cwd: str, tmpdir: str) -> None:
        """Every rank of this node, forked; WarmError when the pool refuses the first."""
        opts = torchrun_options(cfg["argv"])
        base, world = int(cfg["ranks"][0]), int(cfg["warm"]["world"])
        mask, limits, ignored, groups = umask(), rlimits(), cold_ignored(), cgroup_files()
        for local in range(opts["nproc"]):
            error_dir = os.path.join(tmpdir, "warm", str(local))
            os.makedirs(error_dir, 0o700)
            rank_env = elastic_env(env, opts, local, base + local, world,
                                   os.path.join(error_dir, "error.json"))
            target = [a.replace(LOCAL_RANK_MACRO, str(local)) for a in opts["target"]]
            self.fork(base + local, {"cwd": cwd, "umask": mask, "rlimits": limits,
                                     "ignored": ignored, "cgroups": groups, "kind": FORK,
                                     "env": rank_env, "argv": ["-c", CHILD_FLAG, *target]},
                      first=local == 0)
        threading.Thread(target=self.watch, daemon=True, name="warm-ranks").start()

    def fork(self, rank: int, request: Message, first: bool) -> None:
        """One rank: its streams to the pool; its ``ctl`` (the shim parent's) once it runs."""
        streams = [connect_or_none(self.server, rank, role) for role in (OUT, ERR)]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        null = os.open(os.devnull, os.O_RDONLY)
        conn.settimeout(FORK_WITHIN)  # (a pool stopped or hung: this rank starts no other way)
        try:
            conn.connect(self.sock)
            send(conn, request, [null, *(s.fileno() if s else null for s in streams)])
            reply, fds = receive(conn)
        except OSError as exc:
            reply, fds = {"kind": REFUSED, "why": f"the pool did not answer: {exc}"}, []
        finally:
            os.close(null)
            for s in streams:
                if s is not None:
                    s.close()  # the rank holds them now
        if reply is None or reply.get("kind") != PID or len(fds) != 1:
            why = (reply or {}).get("why") or "the pool ended before it forked the rank"
            for fd in fds:
                os.close(fd)
            conn.close()
            if first:  # nothing of this guard's runs: its ranks may still start cold
                raise WarmError(str(why))
            self.lost(rank, POOL_NO_RANK.sent(why=str(why)[:250]))
            return
        conn.settimeout(None)
        one = Pooled(rank, conn, connect_or_none(self.server, rank, CTL), int(reply["pid"]), fds[0])
        started: RankStart = {"pid": one.pid, "shim_pid": one.pid, "t": one.started,
                              "streams": 2, "local_rank": int(request["env"]["LOCAL_RANK"]),
                              "python": sys.executable}
        send_record(one.ctl, START, started)
        with self.lock:
            self.ranks.append(one)
        self.sel.register(conn, selectors.EVENT_READ, one)

    def lost(self, rank: int, problem: Sent) -> None:
        """A rank the pool failed: its error (``problem``, sent) and exit records, as a rank's
        own would be."""
        data = connect_or_none(self.server, rank, DATA)
        send_record(data, ERROR, pool_error(problem))
        if data is not None:
            data.close()
        one = Pooled(rank, socket.socket(), connect_or_none(self.server, rank, CTL), 0, -1)
        self.finish(one, -signal.SIGKILL)
        with self.lock:
            self.ranks.append(one)

    def watch(self) -> None:
        """Each rank's end, as the pool says it (or the pool's own end under it)."""
        while any(r.code is None for r in self.ranks):
            for key, _ in self.sel.select(1.0):
                one: Pooled = key.data
                try:
                    reply, fds = receive(one.conn)
                except OSError:
                    reply, fds = None, []
                for fd in fds:
                    os.close(fd)
                self.sel.unregister(one.conn)
                if reply is not None and reply.get("kind") == STATUS:
                    self.finish(one, int(reply["code"]))
                else:
                    self.lost_under(one)

    def lost_under(self, one: Pooled) -> None:
        data = connect_or_none(self.server, one.rank, DATA)
        send_record(data, ERROR, pool_error(POOL_ENDED.sent()))
        if data is not None:
            data.close()
        self.kill(one)
        self.finish(one, -signal.SIGKILL)

    def finish(self, one: Pooled, code: int) -> None:
        end = time.time()
        ended: RankExit = {"code": code, "t": end, "duration": round(end - one.started, 3)}
        send_record(one.ctl, EXIT, ended)
        if one.ctl is not None:
            one.ctl.close()
        one.conn.close()
        with self.lock:
            one.code = code
            failed = code != 0
            others = [r for r in self.ranks if r.code is None]
        if failed and others:  # torchrun's rule, at its next look: a failure stops the others
            threading.Timer(MONITOR_INTERVAL, self.send_signal, (signal.SIGTERM,)).start()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def poll(self) -> int | None:
        try:
            os.read(self.wake_fd, 512)  # (the guard's wait wakes on a rank's end)
        except BlockingIOError:
            pass
        with self.lock:
            codes = [r.code for r in self.ranks]
        if any(c is None for c in codes):
            return None
        return 0 if all(c == 0 for c in codes) else 1

    def send_signal(self, sig: int) -> None:
        with self.lock:
            live = [r for r in self.ranks if r.code is None]
        for one in live:
            _pidfd_signal(one.pidfd, sig)

    def kill(self, one: Pooled) -> bool:
        """SIGKILL one rank's tree and session; whether anything of it was left."""
        if one.pidfd < 0:
            return False
        tree = [one.pid, *descendants(one.pid)] if _pidfd_signal(one.pidfd, signal.SIGKILL) \
            else []
        for pid in tree[1:]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if one.code is None:
            kill_session(one.pid)
        return bool(tree)

    def kill_all(self) -> bool:
        """SIGKILL what is left of every rank (the teardown's last step)."""
        with self.lock:
            ranks = list(self.ranks)
        return any([self.kill(one) for one in ranks if one.code is None])


def _pidfd_signal(pidfd: int, sig: int) -> bool:
    """``sig`` through the rank's pidfd (never another process that took its pid)."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except OSError:
        return False
    return True



