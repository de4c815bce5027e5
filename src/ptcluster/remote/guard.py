"""The node-side guard: owns one node's part of a job and ends it when the head goes away.

Standard library only: the head ships this file's source over the ssh channel's stdin (see
``remote.bootstrap``), so a node needs nothing but its Python; ptcluster itself need not be
installed there, and no path, host or env value ever passes through a remote shell.

Protocol (one line each, UTF-8):
  stdin  line 1  the bootstrap reads this source (handled before this module runs)
         line 2  JSON config: argv, env, workdir, job_id, heartbeat_timeout, checks
         then    "" (heartbeat), "go" (start the job), "stop" (end it); EOF = the head is gone
  stdout         the job's merged output, byte for byte, plus control lines that start with
                 CONTROL: "ready {facts}", "started {pid}", "hb", "exit {code}", "error {msg}"

Teardown is by process tree, never by name: the guard is a child subreaper, so workers that
torchrun leaves behind are re-parented here and found by walking /proc from our own pid.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

CONTROL = "\x1ePTCG "
PR_SET_CHILD_SUBREAPER = 36


class Guard:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.out_lock = threading.Lock()
        self.stop = threading.Event()
        self.go = threading.Event()
        self.stop_reason = ""
        self.last_hb = time.monotonic()
        self.child: subprocess.Popen[bytes] | None = None
        self.tmpdir = ""
        self.pump_thread: threading.Thread | None = None

    # -- output -------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        try:
            with self.out_lock:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.request_stop("the head's channel is closed")

    def control(self, text: str) -> None:
        self.write((CONTROL + text + "\n").encode())

    def request_stop(self, reason: str) -> None:
        if not self.stop.is_set():
            self.stop_reason = reason
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
            word = line.strip().decode(errors="replace")
            if word == "go":
                self.go.set()
            elif word == "stop":
                self.request_stop("stopped by the head")

    def heartbeat(self) -> None:
        timeout = float(self.cfg.get("heartbeat_timeout", 15))
        while not self.stop.wait(1.0):
            self.control("hb")
            if time.monotonic() - self.last_hb > timeout:
                self.request_stop(f"no heartbeat from the head for {timeout:.0f} s")

    def pump(self, stream: Any) -> None:
        for line in iter(stream.readline, b""):
            self.write(line if line.endswith(b"\n") else line + b"\n")

    # -- checks before the job ----------------------------------------------------------------
    def precheck(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"hostname": socket.gethostname(), "pid": os.getpid(),
                                 "python": sys.executable}
        workdir = self.cfg["workdir"]
        if not os.path.isdir(workdir):
            raise GuardError(f"workdir {workdir} does not exist on this node",
                             "create it, or set workdir: to a directory present on every node")
        port = self.cfg.get("check_port")
        if port:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                # Like torch's TCPStore: connections of a previous job in TIME_WAIT are fine,
                # only a socket still bound or listening on the port is a conflict.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("", int(port)))
                except OSError as exc:
                    raise GuardError(
                        f"master port {port} is already in use on this node ({exc.strerror})",
                        "pass --port with a free port, or set master.port in the cluster file",
                    ) from None
        ifname_for = self.cfg.get("ifname_for")
        if ifname_for:
            facts["interface"] = route_interface(ifname_for)
        return facts

    # -- the job ------------------------------------------------------------------------------
    def start(self, facts: dict[str, Any]) -> None:
        env = dict(os.environ)
        env.update(self.cfg["env"])
        if facts.get("interface"):
            env.setdefault("NCCL_SOCKET_IFNAME", facts["interface"])
            env.setdefault("GLOO_SOCKET_IFNAME", facts["interface"])
        self.tmpdir = tempfile.mkdtemp(prefix="ptcluster-" + self.cfg["job_id"] + "-")
        env["PET_LOG_DIR"] = self.tmpdir  # torchrun's per-rank tee files: removed at the end

        def child_setup() -> None:
            os.setsid()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            # The job dies with the guard even when the guard is SIGKILLed.
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

        self.child = subprocess.Popen(
            self.cfg["argv"], cwd=self.cfg["workdir"], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=child_setup,
        )
        self.control(f"started {self.child.pid}")
        self.pump_thread = threading.Thread(target=self.pump, args=(self.child.stdout,),
                                            daemon=True)
        self.pump_thread.start()

    def teardown(self, grace: float) -> None:
        """SIGTERM the job (torchrun forwards it to its workers), then SIGKILL what is left."""
        child = self.child
        if child is None:
            return
        if child.poll() is None:
            _signal_tree(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + grace
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        for _ in range(50):
            pids = _descendants(os.getpid())
            if not pids:
                break
            _signal_tree(os.getpid(), signal.SIGKILL)
            _reap()
            time.sleep(0.05)

    def run(self) -> int:
        try:
            _set_subreaper()
        except OSError:
            pass
        threading.Thread(target=self.read_stdin, daemon=True).start()
        threading.Thread(target=self.heartbeat, daemon=True).start()
        try:
            facts = self.precheck()
        except GuardError as exc:
            self.control("error " + json.dumps({"problem": exc.problem, "fix": exc.fix}))
            return 2
        self.control("ready " + json.dumps(facts))
        while not self.go.wait(0.1):
            if self.stop.is_set():
                self.control("exit " + json.dumps({"code": 0, "reason": self.stop_reason}))
                return 0
        self.start(facts)
        assert self.child is not None
        code: int | None = None
        while code is None:
            code = self.child.poll()
            _reap_others(self.child.pid)
            if code is None and self.stop.wait(0.1):
                break
        if code is None:
            self.teardown(grace=float(self.cfg.get("grace", 4.0)))
            code = self.child.poll()
            reason = self.stop_reason
        else:
            reason = "job ended"
            self.teardown(grace=1.0)  # workers that outlived torchrun, if any
        if code is None:
            code = -9
        if self.pump_thread is not None:
            self.pump_thread.join(timeout=2.0)  # the last lines before the exit record
        self.control("exit " + json.dumps({"code": code, "reason": reason}))
        _rmtree(self.tmpdir)
        return code if code >= 0 else 128 - code


class GuardError(Exception):
    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix


def route_interface(addr: str) -> str:
    """The interface this node uses to reach ``addr`` (``ip route get``); '' if unknown.

    When ``addr`` is this node's own address the kernel routes it over ``lo``; the interface
    peers reach it on is the one that holds the address, so that one is returned.
    """
    try:
        ip = str(socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0])
        out = subprocess.run(["ip", "-o", "route", "get", str(ip)], capture_output=True,
                             text=True, timeout=5).stdout.split()
        dev = out[out.index("dev") + 1] if "dev" in out else ""
        if dev == "lo" and not ip.startswith("127."):
            for line in subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                                       text=True, timeout=5).stdout.splitlines():
                fields = line.split()
                if len(fields) > 3 and fields[3].split("/")[0] == ip:
                    return fields[1].split("@")[0]
        return dev
    except (OSError, subprocess.SubprocessError, socket.gaierror, IndexError, ValueError):
        return ""


def _set_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _proc_table() -> list[tuple[int, int, str]]:
    """(pid, ppid, state) of every process we can see."""
    table = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # The command name may hold spaces and ')': fields start after the last ')'.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1:
            table.append((int(entry), int(fields[1]), fields[0]))
    return table


def _descendants(root: int) -> list[int]:
    """Live (non-zombie) processes below ``root``."""
    children: dict[int, list[int]] = {}
    for pid, ppid, state in _proc_table():
        if state != "Z":
            children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out


def _signal_tree(root: int, sig: int) -> None:
    for pid in _descendants(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _reap_others(keep: int) -> None:
    """Reap re-parented orphans (we are a subreaper) without stealing the child's status."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == keep:
            return  # nothing to reap, or the child itself: Popen.poll() collects that one
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            return


def _rmtree(path: str) -> None:
    if not path:
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            try:
                os.unlink(os.path.join(root, name))
            except OSError:
                pass
        for name in dirs:
            try:
                os.rmdir(os.path.join(root, name))
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def main() -> int:
    line = sys.stdin.buffer.readline()
    if not line:
        return 2
    cfg = json.loads(line)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: guard.request_stop("the guard was signalled"))
    guard = Guard(cfg)
    return guard.run()


if __name__ == "__main__":
    _code = main()
    sys.stdout.flush()
    # os._exit: the stdin reader thread may sit in a blocking read; a normal interpreter
    # shutdown would then abort on the buffered reader's lock.
    os._exit(_code)
