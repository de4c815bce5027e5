"""A real Slurm on the namespace testbed: one munged, a slurmctld and one slurmd per node.

Built on :class:`tests.support.testbed.Testbed` (nodes with their own network, hostname and
sshd). The
Slurm daemons run *inside* the nodes: each is started by entering a node's namespaces through
its sshd (``nsenter -t PID -n -u -m``), so a slurmd sees its node's address and hostname and
every process it starts lives in that node. slurmctld runs in node 0 (a head node that is also
a compute node, as on many small clusters). One munged on the host serves them all: a unix
socket is a path, shared across network namespaces.

Slurm's node names (``sl0``, ``sl1``, …) are deliberately *not* the nodes' hostnames and resolve
nowhere: only ``NodeAddr`` says where a node is, so anything that used the name or the output of
``hostname`` as an address fails here.

What the testbed cannot show: CPU and GPU binding and cgroup isolation. ``ProctrackType=
proctrack/linuxproc`` and ``TaskPlugin=task/none`` (the cgroup plugins need a systemd-style
cgroup tree per node) mean every step may use every CPU, and there are no GPUs.

Needs root and Debian's ``slurm-wlm`` and ``munge`` (``scripts/test.sh`` installs them).
``close()`` stops every job, every daemon, then the testbed; only processes the testbed started
(by pid file, or living in its namespaces) are signalled.

By hand:  .venv/bin/python -m tests.support.slurmbed     (prints how to use it; Ctrl-C ends it)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.support.testbed import Node, Testbed, TestbedError

CGROUP_V1 = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids")
DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "sbatch", "scontrol", "scancel")


def available() -> str | None:
    """None when a Slurm testbed can be built here, else the reason it cannot."""
    from tests.support.testbed import available as testbed_available

    why = testbed_available()
    if why:
        return why
    for tool in DAEMONS + ("nsenter", "mungekey"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool} is not installed (apt-get install slurm-wlm munge)"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmBed:
    """A :class:`Testbed` of ``n`` nodes under one Slurm controller, every node idle."""

    def __init__(self, n: int = 3, cpus: int = 2) -> None:
        why = available()
        if why:
            raise TestbedError(why)
        self.bed = Testbed(n)
        self.dir = self.bed.dir / "slurm"
        self.names = [f"sl{node.index}" for node in self.bed.nodes]
        self.cpus = cpus
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge.sock"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for key in [k for k in self.env if k.startswith(("SLURM_", "SALLOC_", "SBATCH_",
                                                         "SRUN_"))]:
            if key != "SLURM_CONF":  # a job of the caller's own must not leak into ours
                del self.env[key]
        self._pidfiles: list[Path] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def nodes(self) -> list[Node]:
        return self.bed.nodes

    # -- bring-up -----------------------------------------------------------------------------
    def _start(self) -> None:
        self.dir.mkdir(mode=0o700)
        self._start_munge()
        self._write_conf()
        ctl, *_ = self.bed.nodes
        self._in_node(ctl, _tool("slurmctld"), "-f", str(self.conf))
        self._pidfiles.append(self.dir / "slurmctld.pid")
        for node, name in zip(self.bed.nodes, self.names, strict=True):
            (self.dir / f"spool_{name}").mkdir()
            self._mount_cgroups(node)
            self._in_node(node, _tool("slurmd"), "-f", str(self.conf), "-N", name)
            self._pidfiles.append(self.dir / f"slurmd_{name}.pid")
        self._wait_idle()

    def _start_munge(self) -> None:
        key = self.dir / "munge.key"
        _run(_tool("mungekey"), "--create", "--keyfile", str(key))
        os.chmod(key, 0o600)
        pidfile = self.dir / "munged.pid"
        _run(_tool("munged"), "--key-file", str(key), "--socket", str(self.munge_socket),
             "--pid-file", str(pidfile), "--log-file", str(self.dir / "munged.log"),
             "--seed-file", str(self.dir / "munged.seed"), "--force")
        self._pidfiles.append(pidfile)

    def _write_conf(self) -> None:
        ctl = self.bed.nodes[0]
        d = self.dir
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={node.addr} NodeHostname={node.name} CPUs={self.cpus} "
            "RealMemory=1000 State=UNKNOWN"
            for node, name in zip(self.bed.nodes, self.names, strict=True))
        self.conf.write_text(f"""\
# The testbed's Slurm (tests/support/slurmbed.py): linuxproc + task/none, see the module docstring.
ClusterName=ptc{self.bed.id}
SlurmctldHost={ctl.name}({ctl.addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool_%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd_%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd_%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=30
KillWait=10
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (d / "state").mkdir()
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")

    def _mount_cgroups(self, node: Node) -> None:
        """slurmd needs a cgroup tree; ``ip netns exec`` left the node a fresh /sys without
        one. Mounted in the node's own mount namespace: the host's mounts are untouched."""
        script = ["mount -t tmpfs cgroup_root /sys/fs/cgroup"]
        for ctrl in CGROUP_V1:
            script.append(f"mkdir -p /sys/fs/cgroup/{ctrl} && "
                          f"mount -t cgroup -o {ctrl} cgroup /sys/fs/cgroup/{ctrl}")
        script.append("mkdir -p /sys/fs/cgroup/systemd && "
                      "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd")
        script.append("mkdir -p /sys/fs/cgroup/unified && "
                      "mount -t cgroup2 cgroup2 /sys/fs/cgroup/unified")
        _run("nsenter", "-t", str(self._sshd_pid(node)), "-n", "-u", "-m", "--", "sh", "-c",
             " && ".join(script))

    def _in_node(self, node: Node, *argv: str) -> None:
        """Run a daemon inside ``node`` (it forks into the background itself)."""
        _run("nsenter", "-t", str(self._sshd_pid(node)), "-n", "-u", "-m", "--", *argv,
             env=self.env)

    def _sshd_pid(self, node: Node) -> int:
        return int(node.sshd_pidfile.read_text().strip())

    def _wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if len(states) == len(self.names) and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise TestbedError(f"Slurm nodes never became idle: {states or out.stderr}; "
                                   f"logs in {self.dir}")
            time.sleep(0.2)

    # -- use ----------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (sinfo, squeue, scontrol, sbatch …) against this Slurm."""
        return _run(*argv, check=check, timeout=timeout, env={**self.env, **(env or {})})

    def jobs(self) -> dict[str, str]:
        """Job id -> state of every job Slurm still knows about. A squeue that failed (the
        controller busy: a requeue under way, a socket timeout) is asked again, never taken
        for "no job" (its empty answer would end ``wait_no_jobs`` at once: suspected, not
        shown, in a requeue test that read its log before the job had run again)."""
        for _ in range(20):
            got = self.run("squeue", "-h", "-o", "%i %T", check=False)
            if got.returncode == 0:
                return dict(line.split() for line in got.stdout.splitlines() if line.strip())
            time.sleep(0.5)
        raise AssertionError(f"squeue kept failing: {got.stderr.strip()[-500:]}")

    def steps(self) -> list[str]:
        out = self.run("squeue", "-h", "-s", "-o", "%i", check=False).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def wait_no_jobs(self, timeout: float = 30.0) -> dict[str, str]:
        """Wait until no job is pending or running; what is left when the time is up."""
        deadline = time.monotonic() + timeout
        while True:
            left = {j: s for j, s in self.jobs().items() if s in ("PENDING", "RUNNING",
                                                                  "CONFIGURING", "COMPLETING",
                                                                  "REQUEUED", "SUSPENDED")}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def cancel_all(self) -> None:
        for job in self.jobs():
            self.run("scancel", job, check=False)

    def node_processes(self) -> dict[str, list[tuple[int, str]]]:
        """Per Slurm node name: (pid, cmdline) of processes in the node other than the daemons
        and sshd (what a job left behind)."""
        daemons = {self._sshd_pid(node) for node in self.bed.nodes}
        for pidfile in self._pidfiles:
            try:
                daemons.add(int(pidfile.read_text().strip()))
            except (OSError, ValueError):
                pass
        left: dict[str, list[tuple[int, str]]] = {}
        for node, name in zip(self.bed.nodes, self.names, strict=True):
            for pid in node.pids():
                if pid in daemons or parent_pid(pid) in daemons:  # slurmctld's slurmscriptd
                    continue
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue
                text = cmd.decode(errors="replace").strip()
                if text:
                    left.setdefault(name, []).append((pid, text[:200]))
        return left

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        try:
            if self.conf.exists() and self._pidfiles:
                self.cancel_all()
                self.wait_no_jobs(timeout=15.0)
        except (OSError, subprocess.SubprocessError):
            pass
        # The Slurm daemons all at once (each takes ~2 s to stop), munged after them.
        _kill_pidfiles([p for p in self._pidfiles if not p.name.startswith("munged")])
        _kill_pidfiles([p for p in self._pidfiles if p.name.startswith("munged")])
        self.bed.close()  # kills whatever is left in the nodes' namespaces

    def __enter__(self) -> SlurmBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_pidfiles(paths: list[Path], timeout: float = 5.0) -> None:
    """SIGTERM every daemon, wait for all of them together, SIGKILL the ones left."""
    pids = []
    for path in paths:
        try:
            pid = int(path.read_text().strip())
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
        except (OSError, ValueError):
            continue
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def parent_pid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run(*argv: str, check: bool = True, timeout: float = 60,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def main() -> None:
    with SlurmBed(3) as bed:
        print(f"export SLURM_CONF={bed.conf}")
        print(f"# nodes: {', '.join(bed.names)}; try: salloc -N3 "
              ".venv/bin/ptcluster run -m ptcluster.examples.mnist --epochs 1")
        print(f"# logs in {bed.dir}; Ctrl-C ends it", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
