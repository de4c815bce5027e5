"""The node-side guard: owns one node's part of a job and ends it when the head goes away.

Standard library only: the head ships this module (with the modules it imports) over
the channel's stdin (see ``remote.bootstrap``), so a node needs nothing but its Python.

Protocol (frames of ``node.wire``, one per line):
  stdin   line 1 the packed modules (read by the bootstrap); line 2 the JSON config (the
          ``NodePlan``'s guard config: argv, env, workdir, job_id, checks, timing)
          then ``hb`` (heartbeat), ``go {master_port, warm}`` (start the job: on the port
          the master's guard leased; its ranks from the warm pool found before ``ready``, where
          every node has one), ``stop {reason}``, ``stacks {id,
          native}`` (every rank's stacks, see ``node.guard.progress``); EOF = head gone
  stdout  ``hello``, ``ready {facts}`` (``pool``: a warm pool held for the ranks) or ``error
          {problem, fix}`` (also after ``go``: the pool lost, ``refusal.POOL_LOST``), ``started
          {pid}``, per rank ``rstart``/``rexit``/``rdata`` and its output as ``o``/``e`` text
          frames, torchrun's own output as ``a`` frames (output held up to ``output_hold`` s of the
          config, to write many lines at once: ``guard.outbox``), ``hb {t, idle}`` every
          ``heartbeat_every`` s of the config (``idle``: per rank, seconds since it last
          made progress), ``timing {t, ranks, node}`` with every second heartbeat (at least
          every ``wire.TIMING_EVERY`` s) while ranks run (each rank's main-thread run time and
          run delay, the node's memory: ``guard.schedstat``, for the straggler report),
          ``stacks {id, ranks}``, ``exit {code, reason}``.

Ranks talk to the guard over a Unix socket in the job's private temp dir (``node.rank_wire``;
its path in their env). The guard writes the shim and the stack probe it was shipped with
(``HANDED``) into that dir and gives the ranks the shim's path: code is never in their env. The
shim that wraps every rank connects one stream per stdout/stderr and one for control records,
so output reaches the head tagged with its rank without parsing anyone's log format, and a
rank's exit frame is sent only after its last output line.

Teardown is by process tree, never by name: the guard is a child subreaper, so workers that
torchrun leaves behind are re-parented here and found by walking /proc from our own pid.

This module is the guard's lifecycle (``Guard.run``: hello, prechecks, ready, go, torchrun,
teardown, exit); its concerns are parts of their own: ``link`` (the head: frames in, heartbeats
out, the stop state), ``prechecks`` (the ready facts and the job's leases), ``spawn`` (torchrun,
its environment and the programs handed to the ranks), ``tmpdirs`` (the job's private
directory), ``teardown``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import cast

from ptcluster.node.guard import refusal as R
from ptcluster.node.guard.job_pool import JobPool, attempt_of, let_go, restarts_left
from ptcluster.node.guard.link import HeadLink, StopRequest
from ptcluster.node.guard.machine import MachineWatch
from ptcluster.node.guard.prechecks import node_python, precheck
from ptcluster.node.guard.progress import ProgressMeter
from ptcluster.node.guard.rank_server import EXIT_WAIT, RankServer
from ptcluster.node.guard.refusal import GuardError, refuse
from ptcluster.node.guard.spawn import (
    HANDED,
    agent_error,
    nccl_said,
    pump_agent,
    rank_env,
    start_dir,
    start_torchrun,
    under_slurm,
    use_port,
)
from ptcluster.node.guard.teardown import Child, teardown, wait_child
from ptcluster.node.guard.tmpdirs import job_dir, remove_stale, user_tmp
from ptcluster.node.guard.warm_pool import WarmError, pool_socket
from ptcluster.node.guard.warm_ranks import WarmRanks
from ptcluster.node.sharing.leases import Lease, read_kill_notes
from ptcluster.node.sharing.records import unlink, write_record
from ptcluster.node.sharing.safefile import remove_tree
from ptcluster.node.wire import (
    KILLED_BY,
    STOP_GRACE,
    GuardConfig,
    Kind,
    ReadyFacts,
    encode_text,
    hello,
)


class Guard:
    """One node's part of one job, from ``hello`` to ``exit``."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.stop = StopRequest()
        self.link = HeadLink(cfg, self.stop)
        self.out = self.link.out
        self.finished = threading.Event()
        self.child: Child | None = None
        """torchrun's process, or the ranks of a warm pool (``run --warm``)."""
        self.tmp_parent = ""
        """This user's parent of job directories (``guard.tmpdirs``), checked at the start."""
        self.tmpdir = ""
        self.env: dict[str, str] = {}
        """Its ranks' environment (torchrun's), once started."""
        self.pump_thread: threading.Thread | None = None
        self.job_pool: JobPool | None = None
        """The job's own warm pool here (``--max-restarts``), while this guard holds it."""
        self.pool = ""
        """The socket of the warm pool this node's ranks would come from ("": none)."""
        self.pool_hold: socket.socket | None = None
        """The connection on which this guard holds this user's pool (``run --warm``) from
        before its ``ready`` until its ranks started (the pool's idle clock stands meanwhile)."""
        self.env_use = ""
        """This job's use record of the project's environment it runs in ("": none)."""
        self.leases: list[Lease] = []
        """What this job holds on the node (the job, the master's port, its GPUs): released
        when the guard ends, however it ends (the kernel drops the locks with the process; on
        a normal end, a refusal or an error the guard removes their files first, so that no
        ``ptcluster-*`` file of its stays in /run/lock)."""

    def send(self, kind: str, payload: object = None) -> None:
        self.link.send(kind, payload)

    def request_stop(self, reason: str, by_head: bool = False, signum: int = 0) -> None:
        """Signal-safe (sets state only); the main thread tells the head when it was not the
        head that asked (``stopping`` frame, sent before the teardown)."""
        self.stop.request(reason, by_head, signum)

    def start(self, facts: ReadyFacts) -> None:
        """torchrun, with its ranks' server and the progress meter the heartbeats read; or the
        ranks from the warm pool :meth:`find_pool` found, where the head's ``go`` says every
        node's ranks come from one (``HeadLink.warm``)."""
        if self.link.master_port:
            use_port(self.cfg["argv"], self.link.master_port)
        # the OOM counts before any rank starts; the GPUs the job holds, for the driver's Xids
        self.link.machine = MachineWatch(gpus=list((facts.get("gpus") or {}).get("indices")
                                                   or []))
        ranks = RankServer(rank_socket(self.tmpdir), self.out, self.link.machine)
        self.link.meter = ProgressMeter(ranks.probes)
        self.link.ranks = ranks
        python = node_python(self.cfg["argv"])[0]
        if self.pool and self.link.warm:
            try:
                self.child = WarmRanks(self.pool, ranks.path)
                self.child.start(self.cfg, self.env, start_dir(self.cfg, self.tmpdir),
                                 self.tmpdir)
            except (WarmError, OSError) as exc:
                if not self.whole_world:  # (the other nodes forked theirs: none to meet cold)
                    raise refuse(R.POOL_LOST, why=str(exc)) from None
                teardown(self.child, grace=1.0, spare=self.pool_pid)  # (what it forked)
                self.child = None
                if self.job_pool is not None:  # (a fresh one for the next attempt)
                    self.job_pool.end(keep=False)
                    self.job_pool = JobPool(self.cfg, self.env, python)
                self.out.later(encode_text(Kind.AGENT, None, "ptcluster: no warm pool for this "
                                           f"node's ranks ({exc}): they start cold".encode()))
        if self.child is None:
            torchrun = start_torchrun(self.cfg, self.env, self.tmpdir)
            self.child = torchrun
            self.pump_thread = pump_agent(torchrun.stdout, self.out)
        self.let_pool_go()  # (its forked ranks hold it now; cold ones never will)
        self.send(Kind.STARTED, {"pid": self.child.pid, "warm": isinstance(self.child,
                                                                            WarmRanks)})
        pool = self.job_pool
        if pool is not None and pool.owner is None and restarts_left(self.cfg):
            try:
                pool.start(self.cfg, self.env, python, self.tmpdir)  # (for the next attempt)
            except OSError as exc:  # (optional: the next attempt's ranks then start cold)
                self.out.later(encode_text(Kind.AGENT, None, "ptcluster: no warm pool for a "
                                           f"restart here ({exc}): it would start cold".encode()))

    def find_pool(self, facts: ReadyFacts) -> None:
        """Before ``ready``: :meth:`held_pool`, said in the ready facts (``pool``) where the
        job asks for warm ranks."""
        self.pool = self.held_pool(facts)
        if self.cfg.get("warm"):
            facts["pool"] = bool(self.pool)

    def held_pool(self, facts: ReadyFacts) -> str:
        """Before ``ready``: the job's directory and its ranks' environment, and the socket of
        the warm pool this node's ranks would come from ("": none, said on the console): the
        job's own that a former attempt kept (``--max-restarts``), or this user's (``run
        --warm``, started now where there is none). The ranks come from it only where every
        node has one (the head's ``go``): pooled ranks and torchrun's rendezvous apart."""
        self.tmpdir = job_dir(self.tmp_parent, self.cfg["job_id"], HANDED)
        self.env = rank_env(self.cfg, facts, self.tmpdir, rank_socket(self.tmpdir))
        warm = self.cfg.get("warm") or {}
        if not warm:
            return ""
        python = node_python(self.cfg["argv"])[0]
        if under_slurm():
            if warm.get("job"):
                return ""  # (a restart's pool is the default: nothing to say where none can be)
            why = "not under Slurm (a step's processes are its own)"
        else:
            try:
                if not warm.get("job"):
                    path, self.pool_hold = pool_socket(self.cfg, self.env, python, self.tmpdir,
                                                       self.stop)
                    return path
                self.job_pool = JobPool(self.cfg, self.env, python)
                if not attempt_of(self.cfg):
                    return ""  # (the first attempt: its guard starts the pool once ranks run)
                return self.job_pool.claim()
            except (WarmError, OSError) as exc:
                why = str(exc)
        self.out.later(encode_text(Kind.AGENT, None, f"ptcluster: no warm pool for this "
                                   f"node's ranks ({why}): the job's ranks start cold".encode()))
        return ""

    def run(self) -> int:
        self.link.write(hello("guard"))
        threading.Thread(target=self.link.read_head, daemon=True).start()
        threading.Thread(target=self.link.heartbeat, args=(self.finished,), daemon=True).start()
        threading.Thread(target=self.link.watch, args=(self.finished,), daemon=True).start()
        try:
            self.tmp_parent = user_tmp()
            remove_stale(self.tmp_parent)  # what guards killed by SIGKILL left
            facts = precheck(self.cfg, HANDED, self.leases)
            self.env_use = mark_env_use(self.cfg["argv"][0], self.cfg["job_id"])
        except GuardError as exc:
            self.send(Kind.ERROR, exc.frame())
            if (self.cfg.get("warm") or {}).get("job"):
                let_go(self.cfg)  # (its former attempt's pool: no rank of this one here)
            return 2
        self.find_pool(facts)
        self.send(Kind.READY, facts)
        while not self.link.go.wait(0.1):
            if self.stop.is_set():
                kept = self.end_unstarted()  # (the pool handed on before the exit frame)
                self.send(Kind.EXIT, {"code": 0, "reason": self.stop.reason, "t": time.time(),
                                      "kept_pool": kept})
                return 0
        try:
            self.start(facts)
        except GuardError as exc:
            self.send(Kind.ERROR, exc.frame())
            teardown(self.child, grace=1.0, spare=self.pool_pid)
            self.end_unstarted()
            return 2
        assert self.child is not None
        code = wait_child(self.child, self.stop)
        ended = self.stop.time if code is None else time.time()
        if code is None:
            if not self.stop.by_head:
                self.say_stopping()
            code = teardown(self.child, grace=float(self.cfg.get("grace", STOP_GRACE)),
                            spare=self.pool_pid)
            reason = self.stop.reason
        else:
            reason = "job ended"
            teardown(self.child, grace=1.0, spare=self.pool_pid)  # what outlived torchrun
        # torchrun's own failure (its rendezvous), as its @record wrote it
        said = {"error": agent_error(self.tmpdir)} if code and reason == "job ended" else {}
        if code is None:
            code = -9
        kept = self.hand_pool_on(  # (before the exit frame: the next attempt may claim it)
            (code != 0 if reason == "job ended" else self.stop.by_head), since=ended)
        if self.pump_thread is not None:
            self.pump_thread.join(timeout=2.0)
        if self.link.ranks is not None:
            self.link.ranks.close(EXIT_WAIT)  # every rank's last lines and exit before ours
        self.link.last_look()
        nccl = nccl_said(self.tmpdir, self.env)  # what NCCL chose, from its own log
        self.send(Kind.EXIT, {"code": code, "reason": reason, "t": time.time(),
                              "kept_pool": kept, **said, **nccl})
        if self.link.machine is not None:
            self.link.machine.close()
        remove_tree(self.tmpdir)
        return code if code >= 0 else 128 - code

    @property
    def whole_world(self) -> bool:
        """This node runs every rank of the job (its ranks may start cold without the others)."""
        first, last = self.cfg["ranks"]
        return last - first + 1 >= int((self.cfg.get("warm") or {}).get("world") or 0)

    def let_pool_go(self) -> None:
        """This user's pool no longer held by this guard (its idle clock runs again, unless
        ranks it forked run)."""
        if self.pool_hold is not None:
            self.pool_hold.close()
            self.pool_hold = None

    def hand_pool_on(self, wanted: bool, since: float) -> bool:
        """The job's pool handed on to the next attempt's guard where ``wanted`` and restarts
        are left and the stop is not the user's, else ended (``JobPool.end``): True when
        handed on (the exit frame's ``kept_pool``)."""
        if self.job_pool is None:
            return False
        return self.job_pool.end(keep=wanted and restarts_left(self.cfg) and not self.stop.final,
                                 since=since)

    def end_unstarted(self) -> bool:
        """What a guard whose ranks never ran leaves: its job directory, its hold on this
        user's pool, and the job's pool (kept for the next attempt where the head stopped this
        one and restarts are left: True)."""
        self.let_pool_go()
        kept = self.hand_pool_on(self.stop.by_head, since=time.time())
        if self.link.ranks is not None:
            self.link.ranks.close(0.0)
        if self.link.machine is not None:
            self.link.machine.close()
        remove_tree(self.tmpdir)
        return kept

    @property
    def pool_pid(self) -> int:
        """The job's warm pool where it is this guard's child, else 0."""
        return self.job_pool.pid if self.job_pool is not None else 0

    def say_stopping(self) -> None:
        """Tell the head why the job is being torn down when it was not the head that asked
        (and who, when `ptcluster kill` from anywhere left a note)."""
        stop = self.stop
        killed = read_kill_notes(self.cfg["job_id"]) if stop.signal else {}
        if killed:
            stop.reason = KILLED_BY.format(host=killed.get("host", "?"),
                                           user=killed.get("user", "?"))
        self.send(Kind.STOPPING, {"reason": stop.reason, "t": stop.time, "signal": stop.signal,
                                  "killed_by": stop.reason if killed else ""})


def rank_socket(tmpdir: str) -> str:
    """The ranks' server's socket in the job's directory (its path is in their environment)."""
    return os.path.join(tmpdir, "g.sock")


def mark_env_use(python: str, job_id: str) -> str:
    """Where torchrun runs in a project environment (``ROOT/envs/DIGEST/bin/python``,
    ``node.venv_store``): a record of this job's use of it, naming this guard's pid, in
    ``ROOT/uses`` (``ptcluster venvs --prune`` never removes an environment in use); its
    path, or "" where none."""
    parts = os.path.expanduser(python).split(os.sep)
    if len(parts) < 5 or parts[-4:-2] != ["envs", parts[-3]] or parts[-2:] != ["bin", "python"] \
            or len(parts[-3]) != 64:
        return ""
    path = os.path.join(os.sep.join(parts[:-4]), "uses", f"{job_id}.json")
    try:
        write_record(path, {"pid": os.getpid(), "job_id": job_id, "digest": parts[-3]}, 0o600)
    except OSError:
        return ""
    return path


def main() -> int:
    line = sys.stdin.buffer.readline()
    if not line:
        return 2
    guard = Guard(cast(GuardConfig, json.loads(line)))
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda signum, _: guard.request_stop(
            f"the guard got {signal.Signals(signum).name}", signum=signum))
    if under_slurm():
        signal.signal(signal.SIGUSR2, lambda *_: None)  # for the ranks (see under_slurm)
    try:
        return guard.run()
    except Exception as exc:  # noqa: BLE001 - report it on the channel, never a bare traceback
        guard.send(Kind.ERROR, {"problem": f"the guard failed: {exc!r}",
                                "fix": "report this bug with the node's details: "
                                + traceback.format_exc(limit=-3).replace("\n", " | ")})
        teardown(guard.child, grace=1.0)
        if guard.job_pool is not None:
            guard.job_pool.end(keep=False)
        remove_tree(guard.tmpdir)
        return 70
    finally:
        guard.out.flush()  # what came after the last frame (a descendant's, torchrun's)
        for lease in guard.leases:  # (its ranks are gone: its files go, then its locks)
            lease.release()
        if guard.env_use:
            unlink(guard.env_use)
        guard.finished.set()


if __name__ == "__main__":
    _code = main()
    sys.stdout.flush()
    # os._exit: the stdin reader thread may sit in a blocking read; a normal interpreter
    # shutdown would then abort on the buffered reader's lock.
    os._exit(_code)
