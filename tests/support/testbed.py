"""A multi-host testbed on one machine: network namespaces joined by a bridge, each "node" with
its own address, hostname, /etc/hosts and a real sshd; plus a client key, known_hosts and an ssh
config for the head (the root namespace).

Needs root, iproute2, openssh-server and util-linux's unshare. Names are unique per testbed;
``close()`` tears everything down (also after a failure) and only ever signals processes that
live in the testbed's own namespaces. Traffic goes only to the testbed's own addresses.

By hand:  .venv/bin/python scripts/testbed.py up 3    (prints the cluster file; Ctrl-C ends it)

``Testbed(n, bare=BareOptions(...))`` (``scripts/testbed.py up --bare``) makes nodes with their
own root file systems instead (see ``tests/support/bare.py``): a password login, no key, no
venv, an apt repository of their own. The shared-root mode (default) stays the fast one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support import bare as bare_nodes

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


NEXT_PORT = -1
"""``Testbed.write_cluster``'s default port: the next of ``next_port``."""


class TestbedError(RuntimeError):
    pass


def available() -> str | None:
    """None when a testbed can be built here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces)"
    for tool in ("ip", "ssh", "ssh-keygen", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.path.exists(SSHD):
        return "sshd is not installed (apt-get install openssh-server)"
    return None


def _run(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


@dataclass(frozen=True)
class Node:
    index: int
    name: str  # hostname inside the node, and its alias for ssh
    addr: str
    netns: str
    veth_host: str
    sshd_pidfile: Path

    def pids(self) -> list[int]:
        out = _run("ip", "netns", "pids", self.netns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]


class Testbed:
    def __init__(self, n: int, root: Path | None = None, *,
                 bare: bare_nodes.BareOptions | bool = False) -> None:
        why = available()
        if not why and bare:
            why = bare_nodes.available()
        if why:
            raise TestbedError(why)
        self.bare = (bare if isinstance(bare, bare_nodes.BareOptions) else
                     bare_nodes.BareOptions()) if bare else None
        self.sshd_pids: dict[int, int] = {}
        """Bare nodes: the pid of each node's sshd (its root is /proc/PID/root)."""
        self.id = secrets.token_hex(3)
        self.dir = (root or Path.home() / ".cache" / "ptcluster-testbed") / self.id
        self.bridge = f"ptcb{self.id}"
        self.subnet = _free_subnet()
        hosts = list(self.subnet.hosts())
        self.bridge_addr = str(hosts[0])
        self.nodes = [Node(index=i, name=f"tb{self.id}-n{i}", addr=str(hosts[10 + i]),
                           netns=f"ptc{self.id}n{i}", veth_host=f"ptc{self.id}h{i}",
                           sshd_pidfile=self.dir / f"sshd{i}.pid") for i in range(n)]
        self.unused_addr = str(hosts[200])  # in the subnet, never assigned: "unreachable"
        self.key = self.dir / "id_ed25519"
        self.ssh_config = self.dir / "ssh_config"
        self._made_run_sshd = False
        self._up = False
        try:
            self._bring_up()
        except BaseException:
            self.close()
            raise

    # -- bring-up -----------------------------------------------------------------------------
    def _bring_up(self) -> None:
        self.dir.mkdir(parents=True, mode=0o700)
        os.chmod(self.dir.parent, 0o700)
        self._up = True
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        (self.dir / "authorized_keys").write_text((self.dir / "id_ed25519.pub").read_text())
        os.chmod(self.dir / "authorized_keys", 0o600)
        if not os.path.isdir("/run/sshd"):
            os.makedirs("/run/sshd", mode=0o755)
            self._made_run_sshd = True
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.bridge_addr}/{self.subnet.prefixlen}", "dev",
             self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        self.hosts_text = "\n".join(["127.0.0.1 localhost"] +
                                    [f"{n.addr} {n.name}" for n in self.nodes]) + "\n"
        for node in self.nodes:  # one file per node, so a test can break one node's resolver
            self.hosts_file(node).write_text(self.hosts_text)
        known, config = [], []
        for node in self.nodes:
            if self.bare:
                self._add_bare_node(node)
            else:
                self._add_node(node)
            pub = (self.dir / f"host{node.index}.pub").read_text().split()
            known.append(f"{node.name},{node.addr} {pub[0]} {pub[1]}")
            config.append(f"Host {node.name} {node.addr}\n  HostName {node.addr}\n")
        config.append(f"Host {self.unused_addr}\n  HostName {self.unused_addr}\n")
        self.known_hosts_lines = known
        if self.bare:
            # a new user's head: no key on the nodes, their host keys not yet known
            (self.dir / "known_hosts").write_text("")
            config.append(
                f"Host *\n  User {bare_nodes.USER}\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {self.dir / 'known_hosts'}\n"
                "  GlobalKnownHostsFile /dev/null\n"
                "  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n"
                "  LogLevel ERROR\n")
        else:
            (self.dir / "known_hosts").write_text("\n".join(known) + "\n")
            config.append(
                "Host *\n  User root\n"
                f"  IdentityFile {self.key}\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {self.dir / 'known_hosts'}\n"
                "  GlobalKnownHostsFile /dev/null\n"
                "  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n"
                "  LogLevel ERROR\n")
        self.ssh_config.write_text("\n".join(config))
        for node in self.nodes:
            if self.bare:
                self._wait_port(node)
            else:
                self._wait_ssh(node)

    def _add_netns(self, node: Node) -> tuple[tuple[str, ...], Path]:
        """The node's network namespace on the bridge, and its host key: what both kinds of
        node have. Returns the ``ip netns exec`` prefix and the host key's path."""
        _run("ip", "netns", "add", node.netns)
        _run("ip", "link", "add", node.veth_host, "type", "veth", "peer", "name", "veth0",
             "netns", node.netns)
        _run("ip", "link", "set", node.veth_host, "master", self.bridge)
        _run("ip", "link", "set", node.veth_host, "up")
        ns = ("ip", "netns", "exec", node.netns)
        _run(*ns, "ip", "addr", "add", f"{node.addr}/{self.subnet.prefixlen}", "dev", "veth0")
        _run(*ns, "ip", "link", "set", "veth0", "up")
        _run(*ns, "ip", "link", "set", "lo", "up")
        hostkey = self.dir / f"host{node.index}"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey))
        return ns, hostkey

    def _add_node(self, node: Node) -> None:
        ns, hostkey = self._add_netns(node)
        conf = self.dir / f"sshd{node.index}.conf"
        conf.write_text(
            f"ListenAddress {node.addr}\nPort 22\nHostKey {hostkey}\n"
            f"PidFile {node.sshd_pidfile}\nAuthorizedKeysFile {self.dir / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nPrintMotd no\n"
            "AcceptEnv LANG LC_*\nMaxStartups 100:30:200\nMaxSessions 100\n")
        script = (f"hostname {node.name} && mount --bind {self.hosts_file(node)} /etc/hosts && "
                  f"exec {SSHD} -f {conf} -E {self.dir / f'sshd{node.index}.log'}")
        _run(*ns, "unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script)

    def _add_bare_node(self, node: Node) -> None:
        assert self.bare is not None
        _, hostkey = self._add_netns(node)
        base = self.dir / f"root{node.index}"
        upper, work, merged = base / "upper", base / "work", base / "merged"
        for d in (upper, work, merged):
            d.mkdir(parents=True)
        opts = self.bare.node(node.index)
        bare_nodes.prepare_upper(upper, name=node.name, addr=node.addr, opts=opts,
                                 hostkey=hostkey)
        script = bare_nodes.node_script(name=node.name, merged=merged, upper=upper, work=work,
                                        tag=f"{self.id}n{node.index}", opts=opts)
        try:
            self.sshd_pids[node.index] = bare_nodes.start_node(
                node.netns, script, bare_nodes.users_of(opts))
        except RuntimeError as exc:
            raise TestbedError(str(exc)) from None

    def upper_dir(self, node: Node) -> Path:
        """A bare node's writes (its overlay's upper dir), readable from this machine."""
        return self.dir / f"root{node.index}" / "upper"

    def node_root(self, node: Node) -> Path:
        """A bare node's root file system as this machine sees it (through its sshd)."""
        return Path(f"/proc/{self.sshd_pids[node.index]}/root")

    def root_exec(self, node: Node, *argv: str, input: str | None = None,
                  timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as root inside a bare node (its namespaces and its root)."""
        pid = str(self.sshd_pids[node.index])
        return subprocess.run(["nsenter", "-t", pid, "-m", "-u", "-n", "-r", "-w", *argv],
                              input=input, capture_output=True, text=True, timeout=timeout)

    def trust_host_keys(self) -> None:
        """Put every node's host key in the head's known_hosts (what --accept-new-host-keys
        does)."""
        (self.dir / "known_hosts").write_text("\n".join(self.known_hosts_lines) + "\n")

    def _wait_port(self, node: Node, timeout: float = 15) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((node.addr, 22), timeout=1):
                    return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise TestbedError(f"sshd on {node.name} never answered: {exc}") from None
                time.sleep(0.1)

    def _wait_ssh(self, node: Node, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while True:
            proc = _run("ssh", "-F", str(self.ssh_config), node.name, "true", check=False)
            if proc.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TestbedError(f"sshd on {node.name} never answered: {proc.stderr.strip()}")
            time.sleep(0.1)

    # -- use ----------------------------------------------------------------------------------
    def hosts_file(self, node: Node) -> Path:
        """The node's /etc/hosts (bind-mounted: rewrite it in place, the inode must stay)."""
        return self.dir / f"hosts{node.index}"

    def set_hosts(self, node: Node, text: str | None = None) -> None:
        """Replace a node's /etc/hosts content; None restores the testbed's own."""
        with open(self.hosts_file(node), "r+") as f:
            f.truncate(0)
            f.write(self.hosts_text if text is None else text)

    def nft(self, node: Node, *args: str) -> None:
        """Run nft inside a node's namespace (firewall faults)."""
        _run("ip", "netns", "exec", node.netns, "nft", *args)

    def write_cluster(self, job_dir: Path, slots: list[int] | tuple[int, ...], *,
                      python: str = sys.executable, workdir: str | None = None,
                      port: int | None = NEXT_PORT, **kw: Any) -> str:
        """A cluster file of the first ``len(slots)`` nodes, written in ``job_dir`` under a name
        of its own: this interpreter, ``job_dir`` as the workdir, a rendezvous port of its own
        (``next_port``) unless one is given (None: no ``master:`` line, e.g. for one of the
        test's own in ``extra``). Its path."""
        path = job_dir / f"cluster-{time.monotonic_ns()}.yaml"
        path.write_text(self.cluster_yaml(
            list(slots), python=python, workdir=str(job_dir) if workdir is None else workdir,
            port=next_port() if port == NEXT_PORT else port, **kw))
        return str(path)

    def cluster_yaml(self, slots: list[int], *, extra: str = "", hosts: list[str] | None = None,
                     python: str | None = None, workdir: str | None = None,
                     port: int | None = None) -> str:
        names = hosts or [n.name for n in self.nodes[:len(slots)]]
        lines = ["nodes:"] + [f"  - {{host: {h}, slots: {s}}}" for h, s in
                              zip(names, slots, strict=False)]
        if port:
            lines.append(f"master: {{port: {port}}}")
        # (no ssh options of its own: the tests see the product's keepalive, whose bound on
        # naming a lost node tests/testbed/test_lost_node.py asserts)
        lines.append(f"ssh: {{config_file: {self.ssh_config}}}")
        if python:
            lines.append(f"python: {python}")
        if workdir:
            lines.append(f"workdir: {workdir}")
        return "\n".join(lines) + "\n" + extra

    def ssh(self, node: Node, command: str,
            timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return _run("ssh", "-F", str(self.ssh_config), node.name, command, check=False,
                    timeout=timeout)

    def exec_in(self, node: Node, *argv: str) -> subprocess.Popen[bytes]:
        """Start a process inside a node's network namespace (for faults such as a port hog)."""
        return subprocess.Popen(["ip", "netns", "exec", node.netns, *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)

    def cut_link(self, node: Node) -> None:
        _run("ip", "link", "set", node.veth_host, "down")

    def restore_link(self, node: Node) -> None:
        _run("ip", "link", "set", node.veth_host, "up")

    def node_of_pid(self, pid: int) -> Node | None:
        try:
            mine = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            return None
        for node in self.nodes:
            try:
                target = os.stat(f"/run/netns/{node.netns}").st_ino
            except OSError:
                continue
            if mine == f"net:[{target}]":
                return node
        return None

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        if not self._up:
            return
        for node in self.nodes:
            self._kill_pidfile(node.sshd_pidfile)
        for node in self.nodes:
            if os.path.exists(f"/run/netns/{node.netns}"):
                for pid in node.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            _run("ip", "link", "del", node.veth_host, check=False)  # netns del frees it lazily
            _run("ip", "netns", "del", node.netns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._made_run_sshd and not any(self.dir.parent.iterdir()):
            # only when no other testbed (another test run, a helper's) still needs it
            shutil.rmtree("/run/sshd", ignore_errors=True)
        self._up = False

    @staticmethod
    def _kill_pidfile(path: Path) -> None:
        try:
            pid = int(path.read_text().strip())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            pass

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.213.X.0/24 that no route on this machine already covers."""
    routes = _run("ip", "-4", "route", "show", "table", "all", check=False).stdout
    used = set()
    for line in routes.splitlines():
        first = line.split()[0] if line.split() else ""
        for word in (first, *line.split()):
            try:
                used.add(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    for _ in range(100):
        net = ipaddress.ip_network(f"10.213.{secrets.randbelow(250) + 1}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise TestbedError("no free 10.213.X.0/24 subnet for the testbed")


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


@contextlib.contextmanager
def cpu_capped(node: Node, percent: int) -> Iterator[Path]:
    """Cap what ``node`` starts from now on to ``percent`` % of one CPU: its sshd goes into a
    cgroup v1 ``cpu`` group with that quota (per 100 ms period), so every session and job it
    starts inherits it (``cpu_quota``)."""
    with cpu_quota(int(node.sshd_pidfile.read_text().strip()), percent,
                   f"{os.getpid()}-{node.index}") as group:
        yield group


@contextlib.contextmanager
def cpu_quota(pid: int, percent: int, name: str) -> Iterator[Path]:
    """``pid`` (and what it starts from now on) in a cgroup v1 ``cpu`` group of ``percent`` %
    of one CPU per 100 ms period. Undone even on failure: every task back to the root group,
    the group removed. Skips where the cpu controller is not mounted."""
    if not (CPU_CGROUP / "tasks").exists():
        pytest.skip("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    group = CPU_CGROUP / f"ptcluster-test-{name}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(percent * 1000))
        (group / "tasks").write_text(str(pid))
        yield group
    finally:
        for _ in range(50):  # tasks may still be forking while we move them
            tasks = (group / "tasks").read_text().split()
            for task in tasks:
                try:
                    (CPU_CGROUP / "tasks").write_text(task)
                except OSError:
                    pass  # it ended meanwhile
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@contextlib.contextmanager
def full_workdir(node: Node, path: Path, script: str) -> Iterator[Path]:
    """``path`` as ``node`` sees it: a 16 MiB tmpfs holding ``script`` as ``ranks.py``, filled
    to the last block (its health gate refuses it), mounted in the node's own mount namespace
    (its sshd's: what its sessions see). Unmounted even on failure."""
    path.mkdir()
    inside = ["nsenter", "-t", node.sshd_pidfile.read_text().strip(), "-m"]
    subprocess.run([*inside, "sh", "-c", f"mount -t tmpfs -o size=16m tmpfs {path} && "
                    f"cat > {path}/ranks.py && (dd if=/dev/zero of={path}/filler bs=64k "
                    "2>/dev/null; true)"], input=script, text=True, check=True, timeout=30)
    try:
        yield path
    finally:
        subprocess.run([*inside, "umount", "-l", str(path)], check=False, timeout=30)


_PORTS = itertools.count(29600)


def next_port() -> int:
    """A rendezvous port that no other test of this session used: a job's port may linger in
    TIME_WAIT after it ends, so two tests never share one (each module used to count from a
    number of its own, and two started at the same one)."""
    return next(_PORTS)


B = TypeVar("B")


def bring_up(what: str, why_not: str | None, make: Callable[[], B]) -> B:
    """The testbed ``make()`` starts, for a fixture; here a testbed that cannot run (``why_not``) or
    does not start skips its tests, in CI (``CI=true``) it fails them: CI must run every tier."""
    in_ci = os.environ.get("CI") == "true"
    if why_not:
        if in_ci:
            pytest.fail(f"CI needs the {what}: {why_not}")
        pytest.skip(f"{what} unavailable: {why_not}")
    try:
        return make()
    except TestbedError as exc:
        if in_ci:
            pytest.fail(f"the {what} did not start: {exc}")
        pytest.skip(f"the {what} did not start: {exc}")


def namespace_bed(n: int) -> Iterator[Testbed]:
    """A module fixture's body: ``n`` namespace nodes (this machine's files; ``bring_up``'s
    rules), closed after the module."""
    bed = bring_up("multi-node testbed", available(), lambda: Testbed(n))
    try:
        yield bed
    finally:
        bed.close()


def members(bed: Testbed, job_dir: Path, n: int, config: Callable[[int], dict]) -> list[Any]:
    """The first ``n`` nodes as ``remote.group`` members running this interpreter, node ``i``'s
    program config ``config(i)`` (the namespaces share this machine's files: each node a
    folder of its own)."""
    from ptcluster.cluster.load import load_cluster_file
    from ptcluster.remote.connect import transports
    from ptcluster.remote.group import Member

    spec = load_cluster_file(bed.write_cluster(job_dir, [1] * n), trusted=True)
    reach = transports(spec)
    return [Member(node.host, reach[node.host], sys.executable, config(i))
            for i, node in enumerate(spec.nodes)]


@contextlib.contextmanager
def shaped(bed: Testbed, rate: str) -> Iterator[None]:
    """Every node's link limited to ``rate`` (tc's units: ``100mbit``, ``1gbit``) both ways: a
    ``tbf`` qdisc on its host-side veth (traffic to the node) and on its ``veth0`` (from it).
    No netem here; tbf works on veths. Every qdisc added is removed, also on failure."""
    # a wire has no burst: tbf's bucket lets a message through at the veth's speed as long as
    # the pause before it refilled the bucket. With 10 ms of the rate (1.25 MB at 1 Gbit/s),
    # the reference trainer on 2 nodes all-reduced its 0.41 MB in ~2 ms a step, where 1 Gbit/s
    # needs 3.3 ms. 64 KiB (0.5 ms at 1 Gbit/s, 5 ms at 100 Mbit/s) holds one GSO packet (tbf
    # splits a packet bigger than its burst); 32 KiB gave the same figures
    burst = 64 << 10
    added: list[tuple[str, ...]] = []
    try:
        for node in bed.nodes:
            for prefix, dev in (((), node.veth_host),
                                (("ip", "netns", "exec", node.netns), "veth0")):
                added.append((*prefix, "tc", "qdisc", "del", "dev", dev, "root"))
                _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", "100ms")
        yield
    finally:
        for argv in added:
            _run(*argv, check=False)
