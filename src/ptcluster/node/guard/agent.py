"""The node-side guard: owns one node's part of a job and ends it when the head goes away.

Standard library only: the head ships this source (with the inlined ``wire`` and ``netif``) over
the channel's stdin (see ``remote.bootstrap``), so a node needs nothing but its Python.

Protocol (frames of ``node.wire``, one per line):
  stdin   line 1 the packed source (read by the bootstrap); line 2 the JSON config (the
          ``NodePlan``'s guard config: argv, env, workdir, job_id, checks, timing)
          then ``hb`` (heartbeat), ``go`` (start the job), ``stop {reason}``, ``stacks {id,
          native}`` (every rank's stacks, see ``node.guard.progress``); EOF = head gone
  stdout  ``hello``, ``ready {facts}`` or ``error {problem, fix}``, ``started {pid}``,
          per rank ``rstart``/``rexit``/``rdata`` and its output as ``o``/``e`` text frames,
          torchrun's own output as ``a`` frames (output held up to ``output_hold`` s of the
          config, to write many lines at once: ``node.outbox``), ``hb {t, idle}`` every
          ``heartbeat_every`` s of the config (``idle``: per rank, seconds since it last
          made progress), ``timing {t, ranks, node}`` with every second heartbeat (at least
          every ``wire.TIMING_EVERY`` s) while ranks run (each rank's main-thread run time and
          run delay, the node's memory: ``node.busy``, for the straggler report),
          ``stacks {id, ranks}``, ``exit {code, reason}``.

Ranks talk to the guard over a Unix socket in the job's private temp dir (``node.rank_wire``;
its path in their env). The guard writes the shim and the stack probe it was shipped with
(``HANDED``) into that dir and gives the ranks the shim's path: code is never in their env. The
shim that wraps every rank connects one stream per stdout/stderr and one for control records,
so output reaches the head tagged with its rank without parsing anyone's log format, and a
rank's exit frame is sent only after its last output line.

Teardown is by process tree, never by name: the guard is a child subreaper, so workers that
torchrun leaves behind are re-parented here and found by walking /proc from our own pid.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from ptcluster.node.guard.gpus import claim  # inlined
from ptcluster.node.guard.outbox import Outbox  # inlined
from ptcluster.node.guard.prechecks import (  # inlined
    GuardError,
    check_target,
    lease_job,
    lease_master_port,
    node_python,
)
from ptcluster.node.guard.proctree import (  # inlined
    descendants,
    libc_prctl,
    reap_others,
    remove_stale_tmpdirs,
    rmtree,
    set_subreaper,
    signal_tree,
)
from ptcluster.node.guard.progress import ProgressMeter  # inlined
from ptcluster.node.guard.rank_server import EXIT_WAIT, RankServer  # inlined
from ptcluster.node.guard.schedstat import BusyMeter  # inlined
from ptcluster.node.leases import Leasing, read_kill_notes  # inlined
from ptcluster.node.netif import address_on, route_interface  # inlined
from ptcluster.node.rank_wire import PROBE_FILE, SHIM_FILE, SHIM_VAR, SOCK_VAR  # inlined
from ptcluster.node.wire import (  # inlined
    Kind,
    encode,
    encode_text,
    hello,
    split,
    timing_every,
)

PR_SET_PDEATHSIG = 1
TIMING_OFF_VAR = "PTCLUSTER_STRAGGLER"
"""``PTCLUSTER_STRAGGLER: "0"`` in the cluster file's ``env:`` turns the ``timing`` frames off
(no straggler report; ``benchmarks/straggler_cost.py`` measures what they cost)."""
HANDED: dict[str, str] = globals().get("HANDED", {})
"""The programs this guard hands its ranks (file name -> packed source: the shim and its stack
probe), set by the packer (``remote.bootstrap``) in front of this source; kept from there."""


class Guard:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.out = Outbox(self.emit, float(cfg.get("output_hold", 0.0)))
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.go = threading.Event()
        self.stop_reason = ""
        self.stop_by_head = False
        self.stop_time = 0.0
        self.stop_signal = ""
        self.last_hb = time.monotonic()
        self.child: subprocess.Popen[bytes] | None = None
        self.tmpdir = ""
        self.ranks: RankServer | None = None
        self.pump_thread: threading.Thread | None = None
        self.meter: ProgressMeter | None = None
        self.busy: BusyMeter | None = None
        self.leases: list[Any] = []
        """What this job holds on the node (the master's port): released when the guard ends,
        however it ends (the kernel drops the locks with the process)."""

    def use_port(self, port: int) -> None:
        """The rendezvous port the master's guard chose (``master.port: auto``), told with
        ``go``: into torchrun's command line (torchrun gives it to the ranks as MASTER_PORT)."""
        argv = self.cfg["argv"]
        at = argv.index("--master-port") + 1 if "--master-port" in argv else 0
        if at:
            argv[at] = str(port)

    # -- output -------------------------------------------------------------------------------
    def emit(self, data: bytes) -> None:
        """Into the channel (the outbox's writer: called by one thread at a time)."""
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        except (OSError, ValueError):
            self.request_stop("the head's channel is closed")

    def write(self, data: bytes) -> None:
        """A control frame: at once (with the output held before it, ``node.outbox``)."""
        self.out.now(data)

    def send(self, kind: str, payload: object = None) -> None:
        self.write(encode(kind, payload))

    def request_stop(self, reason: str, by_head: bool = False, signum: int = 0) -> None:
        """Signal-safe (sets state only); the main thread tells the head when it was not the
        head that asked (``stopping`` frame, sent before the teardown; ``signal``: the name of
        the signal that stopped the guard, when one did)."""
        if not self.stop.is_set():
            self.stop_reason, self.stop_by_head, self.stop_time = reason, by_head, time.time()
            self.stop_signal = signal.Signals(signum).name if signum else ""
            self.stop.set()

    # -- threads ------------------------------------------------------------------------------
    def read_stdin(self) -> None:
        while True:
            try:
                line = sys.stdin.buffer.readline()
            except (OSError, ValueError):
                line = b""
            if not line:
                self.request_stop("the head's channel closed (head gone or link lost)")
                return
            self.last_hb = time.monotonic()
            kind, payload = split(line.decode(errors="replace").rstrip("\n"))
            if kind == "go":
                try:
                    told = json.loads(payload) if payload else {}
                except ValueError:
                    told = {}
                if isinstance(told, dict) and told.get("master_port"):
                    self.use_port(int(told["master_port"]))
                self.go.set()
            elif kind == "stacks":
                threading.Thread(target=self.send_stacks, args=(payload,), daemon=True).start()
            elif kind == "stop":
                try:
                    reason = json.loads(payload).get("reason") or ""
                except (ValueError, AttributeError):
                    reason = ""
                self.request_stop(f"stopped by the head{': ' + reason if reason else ''}",
                                  by_head=True)

    def heartbeat(self) -> None:
        timeout = float(self.cfg.get("heartbeat_timeout", 15))
        every = float(self.cfg.get("heartbeat_every", 1.0))
        next_timing = time.monotonic() + timing_every(every)
        while not self.finished.wait(every):  # also during the teardown: we are still here
            beat: dict[str, Any] = {"t": time.time()}
            if self.meter is not None and not self.stop.is_set():
                try:
                    beat["idle"] = self.meter.sample()
                except Exception:  # noqa: BLE001 - progress is advice; the heartbeat is not
                    pass
            self.send("hb", beat)
            if time.monotonic() >= next_timing and not self.stop.is_set() and \
                    self.cfg["env"].get(TIMING_OFF_VAR) != "0":
                next_timing = time.monotonic() + timing_every(every)
                self.send_timing()
            if not self.stop.is_set() and time.monotonic() - self.last_hb > timeout:
                self.request_stop(f"no heartbeat from the head for {timeout:.0f} s")

    def send_timing(self) -> None:
        """Each running rank's main-thread figures since the last frame and the node's, for the
        head's straggler report (``node.busy``: /proc only, nothing inside the ranks)."""
        if self.ranks is None:
            return
        try:
            if self.busy is None:
                self.busy = BusyMeter()
            probes = self.ranks.probes
            pids = dict(probes.pids)
            counts = dict(probes.fr_counts)
            ready = dict(probes.ready)
            completed: dict[int, float] = {}
            for rank in pids:
                got = counts.get(rank)
                if isinstance(got, dict) and "completed" in got:
                    completed[rank] = float(got["completed"])
                elif ready[rank][2] if rank in ready else self.recorder_on():
                    completed[rank] = 0.0  # its recorder is on and it completed none yet
            ranks = self.busy.sample(pids, completed, time.monotonic())
            if ranks:
                self.send(Kind.TIMING, {"t": time.time(), "ranks": ranks, "node": self.busy.node()})
        except Exception:  # noqa: BLE001 - advice only: never the guard's end
            return

    def recorder_on(self) -> bool:
        """Whether the ranks' flight recorder is on (``TORCH_FR_BUFFER_SIZE`` in their env)."""
        try:
            return int(self.cfg["env"].get("TORCH_FR_BUFFER_SIZE") or 0) > 0
        except ValueError:
            return False

    def send_stacks(self, payload: str) -> None:
        """Every rank's stacks for the head (``node.guard.progress``); the job is not disturbed."""
        try:
            ask = json.loads(payload) if payload else {}
        except ValueError:
            ask = {}
        if not isinstance(ask, dict):
            ask = {}
        native = bool(ask.get("native"))
        ranks = self.ranks.probes.collect(native) if self.ranks is not None else {}
        self.send("stacks", {"id": ask.get("id"), "ranks": ranks, "t": time.time()})

    def pump_agent(self, stream: Any) -> None:
        """torchrun's own stdout/stderr (the ranks' output arrives through the rank server)."""
        for line in iter(stream.readline, b""):
            self.out.later(encode_text("a", None, line.rstrip(b"\r\n")))

    # -- checks before the job ----------------------------------------------------------------
    def precheck(self) -> dict[str, Any]:
        if not {SHIM_FILE, PROBE_FILE} <= set(HANDED):  # run from its file, not as shipped
            raise GuardError("this guard was started without the rank programs it hands on",
                             "start it through the head (remote.bootstrap packs it)")
        facts: dict[str, Any] = {"hostname": socket.gethostname(), "pid": os.getpid(),
                                 "python": sys.executable, "time": time.time()}
        try:
            set_subreaper()
            facts["subreaper"] = True
        except OSError as exc:
            facts["subreaper"] = False
            facts["subreaper_error"] = str(exc)
        workdir = os.path.expanduser(self.cfg["workdir"])
        if not os.path.isdir(workdir):
            raise GuardError(f"workdir {workdir} does not exist on this node",
                             "create it, or set workdir: to a directory present on every node")
        self.cfg["workdir"] = facts["workdir"] = workdir
        check_target(self.cfg.get("target") or {}, workdir)
        owner = {k: self.cfg.get(k) for k in ("job_id", "head", "command", "ranks")}
        leasing = Leasing()
        if leasing.off:
            facts["leases_off"] = leasing.off
        self.leases.append(lease_job(owner, leasing))  # what `ptcluster ps` and `kill` find
        port = self.cfg.get("check_port")
        if port:  # the master: the port is this job's until the guard ends
            facts["master_port"], lease = lease_master_port(port, owner, leasing)
            self.leases.append(lease)
        chosen, held = claim(self.cfg.get("gpus"), int(self.cfg.get("slots") or 1), owner,
                             {**os.environ, **self.cfg["env"]}, leasing)
        self.leases.extend(held)
        if chosen:
            facts["gpus"] = chosen
        if self.cfg.get("interface"):
            facts["interface"] = self.cfg["interface"]
            facts["interface_source"] = "cluster file"
        elif self.cfg.get("detect_interface_for"):
            dev, why = route_interface(self.cfg["detect_interface_for"])
            facts["interface"] = dev
            facts["interface_source"] = ("route to the master" if dev else
                                         f"not detected ({why})")
        if facts.get("interface"):  # where peers reach this node (a new master, after a loss)
            facts["address"] = address_on(str(facts["interface"]))
        return facts

    # -- the job ------------------------------------------------------------------------------
    def start(self, facts: dict[str, Any]) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="ptcluster-" + self.cfg["job_id"] + "-")
        with open(os.path.join(self.tmpdir, "guard.pid"), "w") as f:
            f.write(str(os.getpid()))
        for name, source in HANDED.items():  # (the dir is ours alone: mkdtemp made it 0700)
            with open(os.path.join(self.tmpdir, name), "w") as f:
                f.write(source)
        self.ranks = RankServer(os.path.join(self.tmpdir, "g.sock"), self.out)
        self.meter = ProgressMeter(self.ranks.probes)
        env = dict(os.environ)
        slurm = under_slurm()
        if slurm:  # this step's task identity is not the ranks': RANK, WORLD_SIZE are
            for key in SLURM_TASK_VARS:
                env.pop(key, None)
        env.update(self.cfg["env"])
        for key, value in (self.cfg.get("env_defaults") or {}).items():
            env.setdefault(key, value)
        if (facts.get("gpus") or {}).get("indices") is not None:  # only the leased GPUs
            env["CUDA_VISIBLE_DEVICES"] = facts["gpus"]["visible"]
        if facts.get("interface"):
            env.setdefault("NCCL_SOCKET_IFNAME", facts["interface"])
            env.setdefault("GLOO_SOCKET_IFNAME", facts["interface"])
        env[SOCK_VAR] = self.ranks.path
        env[SHIM_VAR] = os.path.join(self.tmpdir, SHIM_FILE)
        env["PET_LOG_DIR"] = self.tmpdir  # torchrun's own files: removed with the temp dir
        prctl = libc_prctl()  # resolved here: the child between fork and exec stays minimal

        def child_setup() -> None:
            os.setsid()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if slurm:  # torchrun would die of it; the ranks install their own handler
                signal.signal(signal.SIGUSR2, signal.SIG_IGN)
            if prctl is not None:  # the job dies with the guard, even on SIGKILL
                prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

        self.child = subprocess.Popen(
            node_python(self.cfg["argv"]), cwd=self.cfg["workdir"], env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=child_setup,
        )
        self.send("started", {"pid": self.child.pid})
        self.pump_thread = threading.Thread(target=self.pump_agent, args=(self.child.stdout,),
                                            daemon=True)
        self.pump_thread.start()

    def wait_child(self) -> int | None:
        """Until torchrun ends or a stop is asked; its exit status, or None if stopped."""
        assert self.child is not None
        while True:
            code = self.child.poll()
            reap_others(self.child.pid)
            if code is not None:
                return code
            if self.stop.wait(0.1):
                return None

    def teardown(self, grace: float) -> int | None:
        """SIGTERM torchrun (it forwards to its workers), then SIGKILL what is left."""
        child = self.child
        if child is None:
            return None
        if child.poll() is None:
            try:
                child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace
            while child.poll() is None and time.monotonic() < deadline:
                reap_others(child.pid)
                time.sleep(0.05)
        for _ in range(50):
            if not descendants(os.getpid()):
                break
            signal_tree(os.getpid(), signal.SIGKILL)
            reap_others(child.pid)
            time.sleep(0.05)
        return child.poll()

    def run(self) -> int:
        self.write(hello("guard"))
        threading.Thread(target=self.read_stdin, daemon=True).start()
        threading.Thread(target=self.heartbeat, daemon=True).start()
        try:
            facts = self.precheck()
        except GuardError as exc:
            self.send("error", {"problem": exc.problem, "fix": exc.fix, "busy": exc.busy})
            return 2
        self.send("ready", facts)
        while not self.go.wait(0.1):
            if self.stop.is_set():
                self.send("exit", {"code": 0, "reason": self.stop_reason, "t": time.time()})
                return 0
        self.start(facts)
        code = self.wait_child()
        if code is None:
            if not self.stop_by_head:
                killed = read_kill_notes(self.cfg["job_id"]) if self.stop_signal else {}
                if killed:  # `ptcluster kill` (from anywhere) said who it was
                    self.stop_reason = f"ended by `ptcluster kill` from " \
                                       f"{killed.get('host', '?')} ({killed.get('user', '?')})"
                self.send("stopping", {"reason": self.stop_reason, "t": self.stop_time,
                                       "signal": self.stop_signal, "killed_by": self.stop_reason
                                       if killed else ""})
            code = self.teardown(grace=float(self.cfg.get("grace", 4.0)))
            reason = self.stop_reason
        else:
            reason = "job ended"
            self.teardown(grace=1.0)  # workers that outlived torchrun, if any
        if code is None:
            code = -9
        if self.pump_thread is not None:
            self.pump_thread.join(timeout=2.0)
        if self.ranks is not None:
            self.ranks.close(EXIT_WAIT)  # every rank's last lines and exit before ours
        self.send("exit", {"code": code, "reason": reason, "t": time.time()})
        rmtree(self.tmpdir)
        return code if code >= 0 else 128 - code


SLURM_TASK_VARS = (
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS",
    "SLURM_NNODES", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_GTIDS", "SLURM_TASK_PID",
)
"""What an srun step tells its one task about itself (task 0 of 1 on 1 node). Left in the
ranks' environment, code that reads a rank's place from Slurm's variables instead of torchrun's
(``SLURM_PROCID`` as the rank, ``SLURM_NTASKS`` as the world) would see a world of one; the
job's own variables (SLURM_JOB_ID, SLURM_JOB_NODELIST, …) stay."""


def under_slurm() -> bool:
    """True when this guard is a Slurm task (an ``srun`` step of ``ptcluster run``).

    Slurm's preemption warning (``sbatch --signal=USR2@T``, ``scancel -s USR2``) goes to every
    process of the step: the ranks get it from Slurm, and the guard and torchrun, whose default
    action for SIGUSR2 is to die, must survive it.
    """
    return "SLURM_STEP_ID" in os.environ


def main() -> int:
    line = sys.stdin.buffer.readline()
    if not line:
        return 2
    guard = Guard(json.loads(line))
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda signum, _: guard.request_stop(
            f"the guard got {signal.Signals(signum).name}", signum=signum))
    if under_slurm():
        signal.signal(signal.SIGUSR2, lambda *_: None)  # for the ranks (see under_slurm)
    try:
        remove_stale_tmpdirs()
        return guard.run()
    except Exception as exc:  # noqa: BLE001 - report it on the channel, never a bare traceback
        guard.send("error", {"problem": f"the guard failed: {exc!r}",
                             "fix": "report this bug with the node's details: "
                             + traceback.format_exc(limit=3).replace("\n", " | ")})
        guard.teardown(grace=1.0)
        rmtree(guard.tmpdir)
        return 70
    finally:
        guard.out.flush()  # what came after the last frame (a descendant's, torchrun's)
        guard.finished.set()


if __name__ == "__main__":
    _code = main()
    sys.stdout.flush()
    # os._exit: the stdin reader thread may sit in a blocking read; a normal interpreter
    # shutdown would then abort on the buffered reader's lock.
    os._exit(_code)
