"""Nodes with systemd as init: systemd-nspawn containers on a private bridge, each a machine of
its own (its own /etc, dpkg database, machine-id, services under ``systemctl``) reached as root
over ssh with the bed's key, with no network but the bridge.

Each node boots an overlayfs clone of one template (``scripts/nspawn_template.sh``, built once
at install time and cached: debootstrap's bookworm minbase with systemd, sshd, python3 and a
``file:`` apt repository that holds what setup installs there: python3-venv, rsync, munge and
Slurm). The recipe, and each pitfall it avoids, is ``../shared/TESTBED.md`` "Machines with
systemd" (measured here): ``--register=no --keep-unit`` (no system bus), a cgroup of its own
per node in the ``systemd`` and ``unified`` hierarchies (shared, the containers' systemd removed
each other's unit cgroups at boot), the veth made by nspawn and attached to the bridge once it
appears (a veth made beforehand is refused: no udev).

By hand (root)::

    .venv/bin/python -m tests.support.nspawn up 3      # prints the nodes and a cluster file
    .venv/bin/python -m tests.support.nspawn add       # one more node
    .venv/bin/python -m tests.support.nspawn down      # everything gone: nodes, mounts, bridge

The bed's state lives in ``STATE/<bridge>/`` so that ``down`` (another process) finds all of it;
``down`` also cleans what a crashed ``up`` left. Only processes the bed started (their pid files)
are signalled.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("PTC_TESTBED_CACHE", "/var/cache/ptcluster-testbed"))
TEMPLATE = CACHE / "nspawn" / "root"
TEMPLATE_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "nspawn_template.sh"
STATE = Path.home() / ".cache" / "ptcluster-nspawn"
"""Off /tmp: sshd's StrictModes and overlayfs want the dirs root's own (TESTBED.md)."""
BRIDGE = os.environ.get("PTC_NSPAWN_BRIDGE", "ptb13s")
SUBNET = ipaddress.ip_network(os.environ.get("PTC_NSPAWN_SUBNET", "10.233.0.0/24"))
CGROUP_TREES = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified")


class NspawnError(RuntimeError):
    pass


def available() -> str | None:
    """None when nspawn nodes can be made here, else why not."""
    if os.geteuid() != 0:
        return "nspawn nodes need root"
    for tool in ("systemd-nspawn", "ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/test.sh installs it as root)"
    if not (TEMPLATE.parent / ".complete").exists():
        return f"no nspawn template at {TEMPLATE} (scripts/nspawn_template.sh builds it)"
    return None


def _run(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NspawnError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


@dataclass(frozen=True)
class Node:
    index: int
    name: str
    """Its hostname, machine name and ssh alias."""
    addr: str
    veth: str
    dir: Path

    @property
    def merged(self) -> Path:
        return self.dir / "merged"

    @property
    def upper(self) -> Path:
        return self.dir / "upper"

    def pid(self) -> int | None:
        try:
            return int((self.dir / "nspawn.pid").read_text())
        except (OSError, ValueError):
            return None

    def leader(self) -> int | None:
        """The container's PID 1 (systemd) as the host sees it."""
        pid = self.pid()
        if pid is None:
            return None
        kids = _run("pgrep", "-P", str(pid), check=False).stdout.split()
        return int(kids[0]) if kids else None


class NspawnBed:
    """Nodes booted from the template on bridge ``bridge`` (``SUBNET``: .1 is this machine, the
    head; node i is .10+i). ``close()`` tears everything down, also after a failure."""

    def __init__(self, n: int = 3, *, bridge: str = BRIDGE, prefix: str = "s13n") -> None:
        why = available()
        if why:
            raise NspawnError(why)
        self.bridge = bridge
        self.prefix = prefix
        self.dir = STATE / bridge
        self.key = self.dir / "id_ed25519"
        self.ssh_config = self.dir / "ssh_config"
        self.known_hosts = self.dir / "known_hosts"
        self.nodes: list[Node] = []
        hosts = list(SUBNET.hosts())
        self.head_addr = str(hosts[0])
        try:
            self._bring_up_bridge()
            for _ in range(n):
                self._boot(self._new_node())
            self.wait_ready(self.nodes)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> NspawnBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bring-up -----------------------------------------------------------------------------
    def _bring_up_bridge(self) -> None:
        if self.dir.exists():  # a bed left behind by a crash: clean it first
            down(self.bridge)
        self.dir.mkdir(parents=True, mode=0o700)
        os.chmod(STATE, 0o700)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.head_addr}/{SUBNET.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def _new_node(self) -> Node:
        i = len(self.nodes)
        node = Node(index=i, name=f"{self.prefix}{i}", addr=str(list(SUBNET.hosts())[9 + i]),
                    veth=f"vb{self.bridge[-4:]}{i}", dir=self.dir / f"{self.prefix}{i}")
        self.nodes.append(node)
        return node

    def add(self) -> Node:
        """One more node, booted and answering ssh."""
        node = self._new_node()
        self._boot(node)
        self.wait_ready([node])
        return node

    def _boot(self, node: Node) -> None:
        for sub in ("upper", "work", "merged"):
            (node.dir / sub).mkdir(parents=True)
        _run("mount", "-t", "overlay", f"ovl_{node.name}", "-o",
             f"lowerdir={TEMPLATE},upperdir={node.upper},workdir={node.dir / 'work'}",
             str(node.merged))
        m = node.merged
        (m / "etc/hostname").write_text(node.name + "\n")
        # what a fresh Debian install writes: its own name on 127.0.1.1, no other node
        (m / "etc/hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {node.name}\n\n"
                                     "::1 localhost ip6-localhost ip6-loopback\n")
        (m / "etc/systemd/network/10-host0.network").write_text(
            f"[Match]\nName=host0\n\n[Network]\nAddress={node.addr}/{SUBNET.prefixlen}\n")
        auth = m / "root/.ssh/authorized_keys"
        auth.write_text(Path(str(self.key) + ".pub").read_text())
        os.chmod(auth, 0o600)
        hostkey = m / "etc/ssh/ssh_host_ed25519_key"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey))
        for tree in CGROUP_TREES:
            os.makedirs(f"{tree}/{node.name}", exist_ok=True)
        # moved into its own cgroups before it becomes systemd-nspawn (TESTBED.md)
        script = ("for t in " + " ".join(CGROUP_TREES) + "; do echo $$ > $t/$1/cgroup.procs; "
                  "done; shift; exec \"$@\"")
        log = open(node.dir / "console.log", "wb")
        proc = subprocess.Popen(
            ["sh", "-c", script, "sh", node.name, "systemd-nspawn", "-q", "-D", str(m),
             "-M", node.name, "--boot", "--register=no", "--keep-unit", "--private-network",
             f"--network-veth-extra={node.veth}:host0", "--console=pipe"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        (node.dir / "nspawn.pid").write_text(str(proc.pid))
        deadline = time.monotonic() + 20
        while _run("ip", "link", "show", node.veth, check=False).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise NspawnError(f"{node.name}: nspawn made no veth: "
                                  f"{(node.dir / 'console.log').read_text()[-800:]}")
            time.sleep(0.05)
        _run("ip", "link", "set", node.veth, "master", self.bridge)
        _run("ip", "link", "set", node.veth, "up")

    def wait_ready(self, nodes: list[Node], timeout: float = 60) -> None:
        """Each node's sshd answers with its host key (known_hosts and ssh_config rewritten)."""
        self._write_ssh_files()
        deadline = time.monotonic() + timeout
        for node in nodes:
            while True:
                proc = subprocess.run(self.ssh(node, "true"), capture_output=True, text=True,
                                      timeout=30)
                if proc.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise NspawnError(f"{node.name}: no ssh after {timeout:.0f} s: "
                                      f"{proc.stderr.strip()[-300:]}")
                time.sleep(0.1)

    def _write_ssh_files(self) -> None:
        known, config = [], []
        for node in self.nodes:
            pub = (node.merged / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()
            known.append(f"{node.name},{node.addr} {pub[0]} {pub[1]}")
            config.append(f"Host {node.name} {node.addr}\n  HostName {node.addr}\n")
        self.known_hosts.write_text("\n".join(known) + "\n")
        self.ssh_config.write_text(
            "".join(config) + f"Host *\n  User root\n  IdentityFile {self.key}\n"
            "  IdentitiesOnly yes\n  BatchMode yes\n  StrictHostKeyChecking yes\n"
            f"  UserKnownHostsFile {self.known_hosts}\n  ConnectTimeout 5\n"
            "  LogLevel ERROR\n")

    def ssh(self, node: Node, command: str) -> list[str]:
        return ["ssh", "-F", str(self.ssh_config), node.name, command]

    def sh(self, node: Node, command: str, timeout: float = 60,
           check: bool = True) -> subprocess.CompletedProcess[str]:
        """``command`` run on ``node`` as root (one string: the remote shell splits it)."""
        proc = subprocess.run(self.ssh(node, command), capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise NspawnError(f"{node.name}: {command}: exit {proc.returncode}: "
                              f"{(proc.stderr or proc.stdout).strip()[-500:]}")
        return proc

    def cluster_yaml(self, nodes: list[Node] | None = None, extra: str = "") -> str:
        lines = ["nodes:", *[f"  - host: {n.name}" for n in nodes or self.nodes],
                 f"ssh: {{config_file: {self.ssh_config}, identity_file: {self.key}}}"]
        return "\n".join(lines) + "\n" + extra

    def close(self) -> None:
        down(self.bridge)


def _stop(node_dir: Path) -> None:
    """A node halted (SIGTERM: systemd's orderly halt; SIGKILL after 15 s), its overlay unmounted,
    its cgroups and nspawn's propagation dir removed."""
    name = node_dir.name
    try:
        pid = int((node_dir / "nspawn.pid").read_text())
    except (OSError, ValueError):
        pid = None
    if pid is not None and _is_nspawn(pid):
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while _is_nspawn(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not _is_nspawn(pid):
                break
    merged = node_dir / "merged"
    if os.path.ismount(merged):
        _run("umount", "-l", str(merged), check=False)
    for tree in CGROUP_TREES:
        _rmdir_tree(Path(tree) / name)
    shutil.rmtree(f"/run/systemd/nspawn/propagate/{name}", ignore_errors=True)


def _is_nspawn(pid: int) -> bool:
    """Whether ``pid`` is still our systemd-nspawn (not a reused pid); a zombie is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return state != "Z" and any(a.endswith(b"systemd-nspawn") for a in argv[:1])


def _rmdir_tree(path: Path) -> None:
    """A cgroup and every cgroup under it, deepest first (cgroups go by rmdir only)."""
    if not path.is_dir():
        return
    for sub, _dirs, _files in sorted(os.walk(path), key=lambda t: -t[0].count("/")):
        try:
            os.rmdir(sub)
        except OSError:
            pass


def down(bridge: str = BRIDGE) -> None:
    """Everything of the bed on ``bridge`` gone: its nodes, mounts, cgroups, veths, bridge,
    state dir. Safe to call again, and on what a crash left."""
    state = STATE / bridge
    if state.is_dir():
        for node_dir in sorted(p for p in state.iterdir() if (p / "upper").is_dir()):
            _stop(node_dir)
    if _run("ip", "link", "show", bridge, check=False).returncode == 0:
        _run("ip", "link", "del", bridge, check=False)
    if state.is_dir():
        if any(os.path.ismount(p / "merged") for p in state.iterdir()):
            raise NspawnError(f"{state}: an overlay is still mounted; not removed")
        shutil.rmtree(state, ignore_errors=True)


def build_template() -> None:
    """The template, built when missing (``scripts/nspawn_template.sh``: ~1 min, network)."""
    subprocess.run(["bash", str(TEMPLATE_SCRIPT)], check=True)


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.support.nspawn",
                                 description="systemd-nspawn testbed nodes (root)")
    ap.add_argument("action", choices=["up", "add", "down", "template"])
    ap.add_argument("nodes", type=int, nargs="?", default=3)
    ap.add_argument("--bridge", default=BRIDGE)
    args = ap.parse_args(argv)
    if args.action == "down":
        down(args.bridge)
        print(f"{args.bridge}: down")
        return 0
    if args.action == "template":
        build_template()
        return 0
    if args.action == "add":
        bed = NspawnBed.__new__(NspawnBed)  # the running bed, from its state dir
        bed.bridge, bed.prefix, bed.dir = args.bridge, "s13n", STATE / args.bridge
        bed.key, bed.ssh_config = bed.dir / "id_ed25519", bed.dir / "ssh_config"
        bed.known_hosts = bed.dir / "known_hosts"
        bed.nodes = []
        for _ in [p for p in bed.dir.iterdir() if (p / "upper").is_dir()]:
            bed._new_node()
        node = bed.add()
        print(f"{node.name:<10} {node.addr}")
        return 0
    try:
        bed = NspawnBed(args.nodes, bridge=args.bridge)
    except NspawnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    cluster = bed.dir / "cluster.yaml"
    cluster.write_text(bed.cluster_yaml())
    for node in bed.nodes:
        print(f"{node.name:<10} {node.addr:<12} pid {node.pid()}")
    print(f"cluster file: {cluster}\nssh:          ssh -F {bed.ssh_config} {bed.nodes[0].name}\n"
          f"down:         python -m tests.support.nspawn down --bridge {bed.bridge}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
