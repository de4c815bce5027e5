"""Bare nodes for the testbed: each node with its own root file system, as separate machines have.

Per node, in the node's own mount namespace: a copy-on-write overlay of this machine's root
(``lowerdir=/``, the node's writes in its own upper dir), with ``/dev``, ``/sys``, a fresh
``/proc``, ``/run``, ``/tmp`` and ``/dev/shm``, and sshd started chroot'ed into it. What a fresh
Ubuntu server would not have is hidden in the upper dir before the mount (overlayfs whiteouts
and opaque directories): the project checkout and its venv, this machine's ``/root`` (pyenv, pip
caches, keys), its pip configuration and wheel mirrors, its apt lists and package cache.

Each node then has its own ``/etc``, ``/home``, ``/usr`` and dpkg database: a login user with a
password and no authorized key, sudo with a password or NOPASSWD or none, ``ufw`` enabled
(default deny, ssh allowed) where asked, ``python3-venv`` and ``rsync`` removed, and a ``file:``
apt repository (made at install time by ``scripts/prepare_testbed.sh``) as its only apt source.
No network but the testbed's bridge.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

CACHE = Path(os.environ.get("PTC_TESTBED_CACHE", "/var/cache/ptcluster-testbed"))
APT_REPO = CACHE / "apt"
WHEELS = CACHE / "wheels"
REPO = Path(__file__).resolve().parents[2]
USER = "ptuser"
PASSWORD = "Tb-pw-7f3a9c-secret"
"""The login password of every bare node's user (a test secret: grepped for afterwards)."""
def _system_python() -> str:
    """``3.X`` of the machine's own python3 (the nodes' Python; the venv's may differ)."""
    try:
        out = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(*sys.version_info[:2],"
                              " sep='.')"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        out = ""
    return out.strip() or f"{sys.version_info[0]}.{sys.version_info[1]}"


REMOVED = ("python3-venv", f"python{_system_python()}-venv", "rsync")
"""Packages a bare node does not have (setup installs them from the node's apt repository)."""


@dataclass(frozen=True)
class BareNode:
    """How one bare node differs from the others."""

    sudo: str = "password"
    """``password`` (sudo asks the user's password), ``nopasswd``, or ``none`` (not a sudoer)."""
    ufw: bool = False
    """ufw enabled: default deny incoming, ssh allowed."""
    extra_users: tuple[tuple[str, str], ...] = ()
    """More login users (name, password), none of them a sudoer."""


@dataclass(frozen=True)
class BareOptions:
    nodes: tuple[BareNode, ...] = field(default_factory=tuple)
    """Per node (missing entries: ``BareNode()``)."""

    def node(self, index: int) -> BareNode:
        return self.nodes[index] if index < len(self.nodes) else BareNode()


NODE_VENV = CACHE / "node-venv"
"""A venv of this machine's system Python with the pinned torch, outside every hidden path: the
bare nodes see it through their overlays, read-only in effect, as a team's nodes see a venv on a
shared file system (what the several-users tests run jobs with, instead of a setup per user)."""


def node_venv() -> Path:
    """:data:`NODE_VENV`'s python, made once from :data:`WHEELS` (offline) when missing; a
    half-made one (no ``.complete``) is made again. Made by ``scripts/prepare_testbed.sh``."""
    python = NODE_VENV / "bin" / "python"
    if (NODE_VENV / ".complete").exists():
        return python
    import fcntl
    import shutil

    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".node-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (two test runs at once make it once)
        if (NODE_VENV / ".complete").exists():
            return python
        shutil.rmtree(NODE_VENV, ignore_errors=True)
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(NODE_VENV)], check=True,
                       capture_output=True, timeout=300)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index",
                        "--find-links", str(WHEELS), "torch==2.13.0"], check=True,
                       capture_output=True, timeout=1200)
        os.chmod(NODE_VENV, 0o755)
        (NODE_VENV / ".complete").touch()
    return python


def available() -> str | None:
    """None when bare nodes can be made here, else why not."""
    if not (APT_REPO / "Packages.gz").exists():
        return f"no apt repository at {APT_REPO} (run scripts/prepare_testbed.sh as root)"
    for tool in ("sudo", "ufw", "chroot", "nsenter"):
        if not any(os.path.exists(os.path.join(d, tool)) for d in
                   ("/usr/bin", "/usr/sbin", "/bin", "/sbin")):
            return f"{tool} is not installed here (scripts/test.sh installs it as root)"
    return None


def hidden_paths() -> tuple[list[Path], list[Path]]:
    """(whited-out paths, opaque-empty directories) of this machine that a bare node must not
    see."""
    gone = [Path("/etc/pip.conf"), Path("/etc/xdg/pip"), Path("/opt/wheels"), Path("/opt/pypi"),
            Path("/opt/pypi-more"), WHEELS, Path("/etc/apt/sources.list")]
    empty = [Path("/root"), Path("/var/lib/apt/lists"), Path("/var/cache/apt/archives"),
             Path("/etc/apt/sources.list.d")]
    # the checkout, and the other checkouts/worktrees next to it
    empty.append(REPO.parent if REPO.parent != Path("/") else REPO)
    if not Path(sys.prefix).is_relative_to(empty[-1]):
        empty.append(Path(sys.prefix))
    return [p for p in gone if os.path.lexists(p)], [p for p in empty if p.is_dir()]


def _upper(upper: Path, path: Path) -> Path:
    return upper / str(path).lstrip("/")


def _write(upper: Path, path: str, text: str, mode: int = 0o644) -> None:
    target = _upper(upper, Path(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    os.chmod(target, mode)


def prepare_upper(upper: Path, *, name: str, addr: str, opts: BareNode, hostkey: Path) -> None:
    """Everything a node's root differs in, written into its overlay's upper dir before the
    mount (the overlay shows upper over lower)."""
    gone, empty = hidden_paths()
    for path in gone:
        target = _upper(upper, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(0, 0))  # an overlayfs whiteout
    for path in empty:
        target = _upper(upper, path)
        target.mkdir(parents=True, exist_ok=True)
        os.chmod(target, stat.S_IMODE(os.stat(path).st_mode))
        os.setxattr(target, "trusted.overlay.opaque", b"y")
    _write(upper, "/etc/hostname", name + "\n")
    # what a fresh Ubuntu install writes: the own name on 127.0.1.1, no other node
    _write(upper, "/etc/hosts", f"127.0.0.1 localhost\n127.0.1.1 {name}\n\n"
           "::1 ip6-localhost ip6-loopback\n")
    _write(upper, "/etc/apt/sources.list.d/testbed.list",
           f"deb [trusted=yes] file:{APT_REPO} ./\n")
    _write(upper, "/etc/ssh/ptc_host_ed25519_key", hostkey.read_text(), 0o600)
    _write(upper, "/etc/ssh/ptc_sshd_config",
           f"ListenAddress {addr}\nPort 22\nHostKey /etc/ssh/ptc_host_ed25519_key\n"
           "PidFile /run/sshd.pid\nPermitRootLogin no\nPasswordAuthentication yes\n"
           "KbdInteractiveAuthentication no\nUsePAM no\nPrintMotd no\n"
           "MaxStartups 100:30:200\nMaxSessions 100\nSubsystem sftp internal-sftp\n")
    if opts.sudo == "password":
        _write(upper, "/etc/sudoers.d/ptc-testbed", f"{USER} ALL=(ALL:ALL) ALL\n", 0o440)
    elif opts.sudo == "nopasswd":
        _write(upper, "/etc/sudoers.d/ptc-testbed", f"{USER} ALL=(ALL:ALL) NOPASSWD: ALL\n",
               0o440)


def node_script(*, name: str, merged: Path, upper: Path, work: Path, tag: str,
                opts: BareNode) -> str:
    """The shell script run in the node's fresh mount+UTS namespace (inside its netns): mount
    its root, make its users, remove what it lacks, start its sshd; prints sshd's pid."""
    m = shlex.quote(str(merged))
    q = shlex.quote
    users = [(USER, PASSWORD), *opts.extra_users]
    lines = [
        "set -e",
        f"hostname {q(name)}",
        f"mount -t overlay {q('ovl_' + tag)} -o "
        f"{q(f'lowerdir=/,upperdir={upper},workdir={work}')} {m}",
        f"mount --rbind /dev {m}/dev",
        f"mount -t tmpfs -o size=512m,mode=1777 shm {m}/dev/shm",
        f"mount --rbind /sys {m}/sys",
        f"mount -t proc proc {m}/proc",
        f"mount -t tmpfs -o mode=755 run {m}/run",
        f"mount -t tmpfs -o mode=1777 tmp {m}/tmp",
        # /run/lock as systemd-tmpfiles makes it on Ubuntu (legacy.conf: 1777, root's)
        f"mkdir -p {m}/run/sshd && mkdir -p -m 1777 {m}/run/lock",
        # passwords arrive on stdin (chpasswd), never in an argv
        *[f"chroot {m} useradd -m -s /bin/bash {q(u)}" for u, _ in users],
        f"head -n {len(users)} | chroot {m} chpasswd",
        f"chroot {m} dpkg -r --force-depends {' '.join(REMOVED)} >/dev/null 2>&1",
    ]
    if opts.ufw:
        lines += [f"chroot {m} ufw allow 22/tcp >/dev/null",
                  f"chroot {m} ufw --force enable >/dev/null"]
    lines += [
        f"chroot {m} /usr/sbin/sshd -f /etc/ssh/ptc_sshd_config -E /var/log/ptc_sshd.log",
        f"for i in $(seq 100); do [ -s {m}/run/sshd.pid ] && break; sleep 0.05; done",
        f"cat {m}/run/sshd.pid",
    ]
    return "\n".join(lines) + "\n"


def start_node(netns: str, script: str, users: list[tuple[str, str]]) -> int:
    """Run ``script`` in a new mount+UTS namespace inside ``netns``; sshd's pid."""
    stdin = "".join(f"{u}:{p}\n" for u, p in users)
    proc = subprocess.run(
        ["ip", "netns", "exec", netns, "unshare", "--uts", "--mount", "--propagation", "private",
         "sh", "-c", script], input=stdin, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"bare node in {netns} did not start: {proc.stderr.strip()}")
    return int(proc.stdout.split()[-1])


def users_of(opts: BareNode) -> list[tuple[str, str]]:
    return [(USER, PASSWORD), *opts.extra_users]
