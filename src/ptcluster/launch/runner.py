"""Runs a :class:`LaunchPlan`: one guard per node, streamed output, first-failure teardown.

Flow: start every node's guard at once -> each checks its node and says ``ready`` -> when all
are ready the head says ``go`` (so a node that cannot be reached or whose master port is taken
stops the launch before any rank starts) -> lines are streamed, logged per rank and parsed for
exit records -> on the first failure, a lost node, Ctrl-C or SIGTERM every guard is told to
stop, and guards that do not finish in time lose their channel, which ends them too.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from ptcluster.launch.plan import SHIM_VAR, LaunchPlan, NodePlan, shim_source
from ptcluster.remote.bootstrap import guard_preamble, node_argv
from ptcluster.remote.guard import CONTROL as GUARD_MARK
from ptcluster.remote.transport import Transport, explain_channel_failure

log = logging.getLogger(__name__)

WORKER_MARK = "\x1ePTCW "
_RANK_PREFIX = re.compile(r"^\[default(\d+)\]:(.*)$", re.DOTALL)
_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank")
_TORCHRUN_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
LAST_LINES = 20


@dataclass(kw_only=True)
class RunOptions:
    """Timing knobs of the runner (defaults suit real clusters and the testbed alike)."""

    ready_timeout: float = 60.0
    """Seconds for every node to connect and pass its checks before the launch is abandoned."""
    node_silence: float = 20.0
    """A node that sends no heartbeat for this long is declared lost (link down, node dead)."""
    guard_heartbeat_timeout: float = 15.0
    """A guard that hears nothing from the head for this long ends its part of the job."""
    stop_grace: float = 4.0
    """Seconds a guard gives torchrun to end its workers after SIGTERM before SIGKILL."""
    stop_deadline: float = 8.0
    """After stop, seconds before the head cuts the channel of a guard that has not finished."""
    deadline: float | None = None
    """Seconds after "go" before the whole job is ended as timed out (None: no limit)."""


@dataclass(kw_only=True)
class RankRecord:
    rank: int
    host: str
    local_rank: int
    pid: int | None = None
    started: float | None = None
    exit_code: int | None = None
    duration: float | None = None
    ended_at: float | None = None
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=LAST_LINES))

    @property
    def status(self) -> str:
        if self.exit_code is None:
            return "not started" if self.started is None else "stopped (job teardown)"
        if self.exit_code < 0:
            return f"killed by {_signame(-self.exit_code)}"
        return "ok" if self.exit_code == 0 else f"exit {self.exit_code}"


@dataclass(kw_only=True)
class NodeOutcome:
    host: str
    node_rank: int
    ready: bool = False
    guard_exit: int | None = None
    reason: str = ""
    transport_exit: int | None = None
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=LAST_LINES))
    last_seen: float = field(default_factory=time.monotonic)
    closed: bool = False


@dataclass(kw_only=True)
class Failure:
    """The root cause of a failed run."""

    host: str
    rank: int | None
    message: str
    fix: str | None = None
    exit_code: int | None = None
    last_lines: list[str] = field(default_factory=list)
    at: float = field(default_factory=time.time)

    def headline(self) -> str:
        who = f"rank {self.rank} on {self.host}" if self.rank is not None else self.host
        text = f"{who}: {self.message}"
        return f"{text}. Fix: {self.fix}" if self.fix else text


@dataclass(kw_only=True)
class RunResult:
    job_id: str
    run_dir: Path
    ranks: list[RankRecord]
    nodes: list[NodeOutcome]
    root_cause: Failure | None
    interrupted: bool
    duration: float

    @property
    def ok(self) -> bool:
        return (self.root_cause is None and not self.interrupted
                and all(r.exit_code == 0 for r in self.ranks))


LineSink = Callable[[str, "int | None", str], None]
"""on_line(host, rank or None for node/agent lines, text)."""


class Runner:
    def __init__(self, plan: LaunchPlan, transports: dict[str, Transport], run_dir: Path,
                 on_line: LineSink | None = None, on_status: Callable[[str], None] | None = None,
                 options: RunOptions | None = None) -> None:
        self.plan = plan
        self.transports = transports
        self.run_dir = run_dir
        self.on_line = on_line or (lambda host, rank, text: None)
        self.on_status = on_status or (lambda text: None)
        self.opts = options or RunOptions()
        self.events: queue.Queue[tuple[str, str, Any]] = queue.Queue()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.nodes = {n.host: NodeOutcome(host=n.host, node_rank=n.node_rank) for n in plan.nodes}
        self.ranks = {r: RankRecord(rank=r, host=n.host, local_rank=r - n.rank_base)
                      for n in plan.nodes for r in n.ranks}
        self.failures: list[Failure] = []
        self._stop_requested = threading.Event()
        self._stop_reason = ""
        self.stopping_since: float | None = None
        self._escalated: set[tuple[str, str]] = set()
        self.interrupted = False
        self._logs: dict[str, IO[str]] = {}
        self._torchrun_rank: dict[str, int] = {}

    # -- public -------------------------------------------------------------------------------
    def request_stop(self, reason: str = "interrupted") -> None:
        """Thread- and signal-safe: ask the run to end everywhere (Ctrl-C, SIGTERM)."""
        self._stop_reason = reason
        self._stop_requested.set()

    def run(self) -> RunResult:
        t0 = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "plan.json").write_text(json.dumps(_plan_json(self.plan), indent=2))
        try:
            for node in self.plan.nodes:
                self._start_node(node)
            self._loop()
        finally:
            self._reap_all()
            for f in self._logs.values():
                f.close()
        result = RunResult(
            job_id=self.plan.job_id, run_dir=self.run_dir,
            ranks=[self.ranks[r] for r in sorted(self.ranks)],
            nodes=[self.nodes[n.host] for n in self.plan.nodes],
            root_cause=self._root_cause(), interrupted=self.interrupted,
            duration=time.monotonic() - t0,
        )
        (self.run_dir / "summary.json").write_text(json.dumps(_result_json(result), indent=2))
        return result

    # -- starting -----------------------------------------------------------------------------
    def _start_node(self, node: NodePlan) -> None:
        env = dict(node.env)
        env[SHIM_VAR] = shim_source()
        config = {
            "job_id": self.plan.job_id, "argv": list(node.argv), "env": env,
            "workdir": node.workdir, "heartbeat_timeout": self.opts.guard_heartbeat_timeout,
            "grace": self.opts.stop_grace,
            "check_port": self.plan.master_port if node.is_master else None,
            "ifname_for": None if node.interface else self.plan.master_addr,
        }
        transport = self.transports[node.host]
        try:
            proc = transport.spawn(node_argv(node.python))
        except OSError as exc:
            self._fail(Failure(host=node.host, rank=None, message=f"cannot start: {exc}"))
            self.nodes[node.host].closed = True
            return
        self.procs[node.host] = proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            proc.stdin.write(guard_preamble(config))
            proc.stdin.flush()
        except OSError:
            pass  # the channel died at once: the reader threads report why
        threading.Thread(target=self._read_stdout, args=(node.host, proc.stdout),
                         daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(node.host, proc.stderr),
                         daemon=True).start()

    def _read_stdout(self, host: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self.events.put(("out", host, raw.decode(errors="replace").rstrip("\r\n")))
        self.events.put(("closed", host, None))

    def _read_stderr(self, host: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self.events.put(("err", host, raw.decode(errors="replace").rstrip("\r\n")))

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        started = time.monotonic()
        next_beat = 0.0
        went = False
        went_at = 0.0
        while not all(n.closed for n in self.nodes.values()):
            now = time.monotonic()
            if self._stop_requested.is_set() and self.stopping_since is None:
                self.interrupted = True
                self._stop_all(self._stop_reason)
            if now >= next_beat:
                self._send_all(b"\n")
                next_beat = now + 1.0
            if not went and self.stopping_since is None:
                if all(n.ready for n in self.nodes.values()):
                    went = True
                    went_at = now
                    self.on_status(f"all {len(self.nodes)} node(s) ready; starting "
                                   f"{self.plan.world_size} rank(s)")
                    self._send_all(b"go\n")
                elif now - started > self.opts.ready_timeout:
                    slow = [h for h, n in self.nodes.items() if not n.ready]
                    self._fail(Failure(host=", ".join(slow), rank=None,
                                       message=f"not ready after {self.opts.ready_timeout:.0f} s",
                                       fix="check that the node is reachable (`ptcluster doctor`)"))
            if went and self.opts.deadline is not None and self.stopping_since is None \
                    and now - went_at > self.opts.deadline:
                self._fail(Failure(host=self.plan.nodes[0].host, rank=None,
                                   message=f"timed out after {self.opts.deadline:.0f} s",
                                   fix="a collective hung or a rank is stuck: check the ports "
                                   "and interface findings of `ptcluster doctor`"))
            self._check_silence(now)
            self._check_stop_deadline(now)
            try:
                kind, host, payload = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            self._handle(kind, host, payload)
            while True:  # drain what is already there before the next round of checks
                try:
                    kind, host, payload = self.events.get_nowait()
                except queue.Empty:
                    break
                self._handle(kind, host, payload)

    def _check_silence(self, now: float) -> None:
        for node in self.nodes.values():
            if node.closed or not node.ready:
                continue
            silent = now - node.last_seen
            if silent > self.opts.node_silence:
                node.closed = True  # gone as far as we can tell; its guard ends itself
                node.reason = f"no heartbeat for {silent:.0f} s"
                self._fail(Failure(host=node.host, rank=None,
                                   message=f"node lost: no heartbeat for {silent:.0f} s "
                                   "(link down or node dead)",
                                   fix="check the node's network and power; `ptcluster doctor`"))
                self._kill_transport(node.host, signal.SIGKILL)

    def _check_stop_deadline(self, now: float) -> None:
        if self.stopping_since is None:
            return
        late = now - self.stopping_since
        # Each step is taken once per node: stop (the node spared at first included), then
        # SIGTERM to its channel, then SIGKILL.
        steps = ((self.opts.stop_deadline + 4.0, "kill"), (self.opts.stop_deadline, "term"),
                 (self.opts.stop_deadline / 2, "stop"))
        for host, node in self.nodes.items():
            step = next((name for after, name in steps if late > after), None)
            if node.closed or step is None or (host, step) in self._escalated:
                continue
            self._escalated.add((host, step))
            if step == "kill":
                self._kill_transport(host, signal.SIGKILL)
                node.closed = True
                node.reason = node.reason or "channel cut after the stop deadline"
            elif step == "term":
                self._kill_transport(host, signal.SIGTERM)
            else:
                self._send(host, b"stop\n")

    # -- events -------------------------------------------------------------------------------
    def _handle(self, kind: str, host: str, payload: Any) -> None:
        node = self.nodes[host]
        node.last_seen = time.monotonic()
        if kind == "out":
            self._handle_line(host, payload)
        elif kind == "err":
            node.stderr.append(payload)
            self._write_log(f"node{node.node_rank}-{host}", payload)
            self.on_line(host, None, payload)
        elif kind == "closed":
            self._handle_closed(host)

    def _handle_line(self, host: str, line: str) -> None:
        if line.startswith(GUARD_MARK):
            self._handle_guard(host, line[len(GUARD_MARK):])
            return
        plan_node = self._plan_node(host)
        m = _RANK_PREFIX.match(line)
        if m is None:
            self._handle_agent_line(host, line)
            return
        rank = plan_node.rank_base + int(m.group(1))
        text = m.group(2)
        if text.startswith(WORKER_MARK):
            self._handle_worker(rank, text[len(WORKER_MARK):])
            return
        record = self.ranks[rank]
        record.last_lines.append(text)
        self._write_log(f"rank{rank}", text)
        self.on_line(host, rank, text)

    def _handle_agent_line(self, host: str, line: str) -> None:
        """torchrun's own output; its failure table gives exit codes of killed ranks."""
        node = self.nodes[host]
        self._write_log(f"node{node.node_rank}-{host}", line)
        self.on_line(host, None, line)
        m = _TORCHRUN_RANK.match(line)
        if m:
            self._torchrun_rank[host] = int(m.group(1))
            return
        m = _TORCHRUN_EXIT.match(line)
        if m and host in self._torchrun_rank:
            record = self.ranks.get(self._torchrun_rank.pop(host))
            if record is not None and record.exit_code is None:
                record.exit_code = int(m.group(1))

    def _handle_worker(self, rank: int, text: str) -> None:
        fields = dict(f.split("=", 1) for f in text.split()[1:] if "=" in f)
        record = self.ranks[rank]
        if text.startswith("start"):
            record.started = time.time()
            record.pid = int(fields.get("pid", 0)) or None
        elif text.startswith("exit"):
            record.exit_code = int(fields.get("code", 1))
            record.duration = float(fields.get("duration", 0))
            record.ended_at = float(fields.get("end", 0)) or time.time()
            if record.exit_code != 0 and self.stopping_since is None:
                self._fail(Failure(host=record.host, rank=rank,
                                   message=f"exited with code {record.exit_code}",
                                   exit_code=record.exit_code,
                                   last_lines=list(record.last_lines)))

    def _handle_guard(self, host: str, text: str) -> None:
        word, _, rest = text.partition(" ")
        node = self.nodes[host]
        if word == "ready":
            node.ready = True
            facts = json.loads(rest or "{}")
            if facts.get("interface"):
                self.on_status(f"{host}: sockets on interface {facts['interface']} "
                               "(route to the master)")
        elif word == "error":
            info = json.loads(rest)
            self._fail(Failure(host=host, rank=None, message=info["problem"], fix=info["fix"]))
        elif word == "exit":
            info = json.loads(rest)
            node.guard_exit = int(info["code"])
            node.reason = info.get("reason", "")
            if node.guard_exit != 0 and self.stopping_since is None:
                self._fail(Failure(host=host, rank=None, exit_code=node.guard_exit,
                                   message=f"torchrun exited with code {node.guard_exit}"))

    def _handle_closed(self, host: str) -> None:
        node = self.nodes[host]
        proc = self.procs.get(host)
        if proc is not None:
            try:
                node.transport_exit = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                node.transport_exit = proc.wait()
        if not node.closed and node.guard_exit is None and self.stopping_since is None:
            self._fail(self._lost_channel(node))
        node.closed = True

    def _lost_channel(self, node: NodeOutcome) -> Failure:
        err = [line for line in node.stderr if line.strip()]
        if node.ready:
            detail = err[-1] if err else f"exit status {node.transport_exit}"
            return Failure(host=node.host, rank=None, message=f"connection lost: {detail}",
                           fix="check the node's network and power (`ptcluster doctor`)",
                           exit_code=node.transport_exit, last_lines=err)
        problem, fix = explain_channel_failure(err, node.transport_exit,
                                               self._plan_node(node.host).python)
        return Failure(host=node.host, rank=None, message=f"cannot start the job: {problem}",
                       fix=fix, exit_code=node.transport_exit, last_lines=err)

    # -- stopping -----------------------------------------------------------------------------
    def _fail(self, failure: Failure) -> None:
        self.failures.append(failure)
        log.debug("failure: %s", failure.headline())
        if self.stopping_since is None:
            # A failed rank's own torchrun ends that node's other ranks and reports them;
            # it gets until the stop deadline to do so before its guard is told to stop.
            spare = failure.host if failure.rank is not None else None
            self._stop_all(failure.headline(), spare=spare)

    def _stop_all(self, reason: str, spare: str | None = None) -> None:
        self.stopping_since = time.monotonic()
        self.on_status(f"stopping the job on every node: {reason}")
        self._send_all(b"stop\n", skip=spare)

    def _send_all(self, data: bytes, skip: str | None = None) -> None:
        for host in self.procs:
            if host != skip:
                self._send(host, data)

    def _send(self, host: str, data: bytes) -> None:
        proc = self.procs.get(host)
        if proc is None or proc.stdin is None or self.nodes[host].closed:
            return
        try:
            proc.stdin.write(data)
            proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def _kill_transport(self, host: str, sig: int) -> None:
        proc = self.procs.get(host)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def _reap_all(self) -> None:
        for host, proc in self.procs.items():
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            try:
                proc.wait(timeout=self.opts.stop_deadline)
            except subprocess.TimeoutExpired:
                self._kill_transport(host, signal.SIGKILL)
                proc.wait()

    # -- results ------------------------------------------------------------------------------
    def _root_cause(self) -> Failure | None:
        ranked = [(self.ranks[f.rank].ended_at or f.at, i, f)
                  for i, f in enumerate(self.failures) if f.rank is not None]
        if ranked:
            # Earliest end on the nodes, not arrival order: a peer's "connection reset" can
            # reach the head before the line of the rank that really failed.
            return min(ranked)[2]
        return self.failures[0] if self.failures else None

    def _plan_node(self, host: str) -> NodePlan:
        return self.plan.nodes[self.nodes[host].node_rank]

    def _write_log(self, name: str, line: str) -> None:
        f = self._logs.get(name)
        if f is None:
            f = self._logs[name] = open(self.run_dir / f"{name}.log", "a", encoding="utf-8")
        f.write(line + "\n")
        f.flush()


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _plan_json(plan: LaunchPlan) -> dict[str, Any]:
    data = asdict(plan)
    for node in data["nodes"]:
        node["env"] = dict(node["env"])
    return data


def _result_json(result: RunResult) -> dict[str, Any]:
    rc = result.root_cause
    return {
        "job_id": result.job_id, "ok": result.ok, "interrupted": result.interrupted,
        "duration_s": round(result.duration, 3),
        "root_cause": None if rc is None else {
            "host": rc.host, "rank": rc.rank, "message": rc.message, "fix": rc.fix,
            "exit_code": rc.exit_code, "last_lines": rc.last_lines},
        "ranks": [{"rank": r.rank, "host": r.host, "local_rank": r.local_rank,
                   "exit_code": r.exit_code, "status": r.status, "duration_s": r.duration}
                  for r in result.ranks],
        "nodes": [{"host": n.host, "node_rank": n.node_rank, "guard_exit": n.guard_exit,
                   "reason": n.reason, "transport_exit": n.transport_exit}
                  for n in result.nodes],
    }
