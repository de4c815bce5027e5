"""Setup's facts about a node: one function per fact section, keyed by the section names setup's
steps ask for (``setup.plan.STEP_DEFS``: ``facts {"only": [...]}``), as pyinfra declares facts
(a command, or a file, and its parse); and the one runner of the commands setup starts.

Standard library only; a part of setup's node program (``node.setup_agent``), shipped with it
(``remote.bootstrap``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypedDict

from ptcluster.node.facts.accel import NVML_LIB, gpus, pci_gpu_count
from ptcluster.node.facts.firewall import FirewallState, firewall_state
from ptcluster.node.facts.netif import route_interface
from ptcluster.node.facts.slurm_facts import SlurmFacts, slurm_facts

C_ENV = {"LC_ALL": "C", "LANG": "C"}
"""Commands whose words we look at run in the C locale."""


RUNS = 'printf "%s\\n" "$0" >&2; exec "$@"'
"""What sudo runs (as ``sh -c RUNS MARK ARGV...``): it says ``MARK`` before it becomes the
command, so that the command's input is written only then (``Commands.sudo``)."""


def _feed(p: subprocess.Popen[bytes], data: bytes, close: bool = True) -> None:
    """``data`` to ``p``'s input (then its end); a command that is gone took none."""
    assert p.stdin is not None
    try:
        if data:
            p.stdin.write(data)
            p.stdin.flush()
        if close:
            p.stdin.close()
    except (OSError, ValueError):
        pass


class Commands:
    """The commands setup runs on this node, each in its own process group (so that the whole
    command, sudo, apt, dpkg..., can be ended): those running now, and whether setup was stopped
    (the head said stop or went away: no command starts any more)."""

    def __init__(self) -> None:
        self.running: set[subprocess.Popen[bytes]] = set()
        self.stopping = threading.Event()

    def run(self, argv: list[str], *, stdin: str | None = None, timeout: float = 30.0,
            env: dict[str, str] | None = None) -> tuple[int, str]:
        p = self._start(argv, env)
        if isinstance(p, tuple):
            return p
        try:
            out, _ = p.communicate(None if stdin is None else stdin.encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            end(p)
            return 124, f"{argv[0]}: timed out after {timeout:.0f} s"
        finally:
            self.running.discard(p)
        return p.returncode, out.decode(errors="replace")

    def sudo(self, argv: list[str], password: str, *, stdin: str | None = None,
             timeout: float = 30.0, env: dict[str, str] | None = None) -> tuple[int, str]:
        """``argv`` as root by ``sudo -S`` and ``password``: the password is written only once
        sudo asked for it (its prompt, a nonce, seen), the command's ``stdin`` only once the
        command runs (a wrapper says so first). Where sudo runs a command without asking
        (NOPASSWD for it), the password is never written: with the password first on stdin,
        such a command read it as its input (the new /etc/hosts began with it)."""
        nonce = os.urandom(8).hex()
        prompt, ready = f"[ptcluster-sudo-{nonce}]", f"[ptcluster-runs-{nonce}]"
        p = self._start(["sudo", "-k", "-S", "-p", prompt, "--", "sh", "-c", RUNS, ready, *argv],
                        env)
        if isinstance(p, tuple):
            return p
        try:
            code, out = self._converse(p, prompt.encode(), ready.encode() + b"\n",
                                       password.encode() + b"\n", (stdin or "").encode(),
                                       time.monotonic() + timeout)
        finally:
            self.running.discard(p)
            for pipe in (p.stdin, p.stdout):
                try:
                    pipe.close() if pipe is not None else None
                except OSError:
                    pass
        text = out.decode(errors="replace").replace(prompt, "").replace(ready + "\n", "")
        return code, text if code != 124 else f"{argv[0]}: timed out after {timeout:.0f} s"

    @staticmethod
    def _converse(p: subprocess.Popen[bytes], prompt: bytes, ready: bytes, password: bytes,
                  data: bytes, deadline: float) -> tuple[int, bytes]:
        """``sudo``'s half: read the output; at sudo's prompt write the password (at a second
        one, end its input: the password was wrong); once the command runs, its input."""
        assert p.stdin is not None and p.stdout is not None
        out, asked, runs = bytearray(), 0, False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                end(p)
                return 124, bytes(out)
            if not select.select([p.stdout], [], [], left)[0]:
                continue
            chunk = os.read(p.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
            if runs:
                continue
            if out.count(prompt) > asked:
                asked += 1
                _feed(p, password if asked == 1 else b"", close=asked > 1)
            if ready in out:
                runs = True
                threading.Thread(target=_feed, args=(p, data), daemon=True).start()
        try:
            return p.wait(max(0.1, deadline - time.monotonic())), bytes(out)
        except subprocess.TimeoutExpired:
            end(p)
            return 124, bytes(out)

    def _start(self, argv: list[str], env: dict[str, str] | None
               ) -> subprocess.Popen[bytes] | tuple[int, str]:
        """The command started in its own process group (and counted as running), or why not."""
        if shutil.which(argv[0]) is None and not os.path.isabs(argv[0]):
            return 127, f"{argv[0]}: not installed"
        if self.stopping.is_set():
            return 130, f"{argv[0]}: not started, setup was stopped"
        try:
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, **C_ENV, **(env or {})})
        except OSError as exc:
            return 126, f"{argv[0]}: {exc}"
        self.running.add(p)
        if self.stopping.is_set():  # stopped while it was being started: stop() may have missed it
            end(p)
        return p

    def stop(self) -> None:
        """No command starts any more (one being started now ends itself, see ``run``); those
        running end."""
        self.stopping.set()
        for p in list(self.running):
            end(p)


COMMANDS = Commands()
"""This program's commands (one program, one node)."""


def run(argv: list[str], *, stdin: str | None = None, timeout: float = 30.0,
        env: dict[str, str] | None = None) -> tuple[int, str]:
    """``(exit status, stdout and stderr)`` of a command (``COMMANDS``): 127 when it is not
    installed, 130 once setup was stopped, 124 when it timed out."""
    return COMMANDS.run(argv, stdin=stdin, timeout=timeout, env=env)


def end(p: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the command's group (apt, dpkg and pip stop cleanly), then SIGKILL."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except OSError:
            return
        try:
            p.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


class _Config(TypedDict):
    pubkey: str
    """The head's public key (the ``key`` fact: is it authorized here)."""
    venv: str
    wheelhouse: str
    env_file: str
    """Paths (``~`` is the node's home)."""
    packages: list[str]
    """The apt packages setup installs (the ``apt`` fact: which are)."""
    master_addr: str
    """The master's address as the head resolves it (the ``env`` fact's route)."""
    workdir: str
    """The node's workdir ("": none; the ``workdir`` fact)."""


class SetupConfig(_Config, total=False):
    """Setup's node program's config line (``setup.apply.Setup`` writes it; each fact reads its
    part through ``FactHost.cfg``)."""

    hash_only: list[str] | None
    """The wheels the ``wheels`` fact hashes (a ``facts`` ask may set it; None: all)."""


class FactHost(Protocol):
    """What a fact reads of setup's node program (``setup_agent.Node``)."""

    cfg: SetupConfig
    sudo_mode: str | None
    ran: dict[tuple[str, ...], tuple[int, str]]

    def root_run(self, argv: list[str], data: str | None = None, timeout: float = 30.0,
                 env: dict[str, str] | None = None) -> tuple[int, str]: ...

    def scrub(self, text: str) -> str: ...


class Sudo(TypedDict, total=False):
    """How this node's user becomes root (``setup_agent.Node.sudo``)."""

    mode: str
    """root | nopasswd | password | needs-password | wrong-password | none."""
    why: str | None


class OsRelease(TypedDict):
    """``/etc/os-release``'s (each '' where it says none)."""

    ID: str
    ID_LIKE: str
    VERSION_ID: str
    PRETTY_NAME: str


class SetupGpu(TypedDict):
    """NVIDIA GPUs: on the PCI bus (with or without a driver), the driver, the capabilities."""

    count: int
    driver: str | None
    compute_capability: list[str]


class Venv(TypedDict, total=False):
    """The venv setup makes: ``{exists: False}``; ``{exists, ok: True, python, dists}``; or
    ``{exists, ok: False, why}`` (its interpreter failed)."""

    exists: bool
    ok: bool
    python: str
    """``MAJOR.MINOR``."""
    dists: dict[str, str | None]
    """Each of ``VENV_DISTS``: its version, None where it is not installed."""
    why: str


class Workdir(TypedDict):
    path: str
    """The node's (``~`` expanded there)."""
    exists: bool


class SetupFacts(TypedDict, total=False):
    """A node's answer to setup's ``facts`` ask: who and where it is (every answer) and the
    sections asked for (``SECTIONS``; each fact returns its keys). The head checks it as it
    arrives (``remote.replies.facts_reply``) and reads it as this (``setup.plan``,
    ``setup.slurm``, ``setup.apply``): a key renamed here is mypy's error there."""

    user: str
    uid: int
    home: str
    hostname: str
    python: str
    """``MAJOR.MINOR`` of the interpreter setup's agent runs on."""
    python_path: str
    sudo: Sudo
    key_authorized: bool
    """``key``: the head's public key is in ``authorized_keys``."""
    packages: dict[str, bool]
    """``apt``: each package asked for, installed or not."""
    venv: Venv
    """``venv``."""
    os: OsRelease
    """``os``: ``/etc/os-release``'s."""
    gpu: SetupGpu
    """``os``: the GPUs."""
    firewall: FirewallState
    """``firewall``: ``node.facts.firewall.firewall_state``."""
    wheelhouse: dict[str, str]
    """``wheels``: file name -> sha256."""
    hosts: str | None
    """``hosts``: ``/etc/hosts``."""
    workdir: Workdir
    env_file: str | None
    interface: str | None
    interface_why: str
    """``env``: the env file's text, the interface to the master (or why unknown)."""
    slurm: SlurmFacts
    """``slurm``: ``node.facts.slurm_facts.slurm_facts``."""


Fact = Callable[[FactHost], SetupFacts]


def key_fact(host: FactHost) -> SetupFacts:
    return {"key_authorized": _has_key(host.cfg["pubkey"])}


def apt_fact(host: FactHost) -> SetupFacts:
    return {"packages": _installed(host.cfg["packages"])}


def venv_fact(host: FactHost) -> SetupFacts:
    return {"venv": _venv(os.path.expanduser(host.cfg["venv"]))}


def os_fact(host: FactHost) -> SetupFacts:
    return {"os": _os_release(), "gpu": _gpu()}


def firewall_fact(host: FactHost) -> SetupFacts:
    def as_root(argv: list[str]) -> tuple[int, str]:
        if tuple(argv) in host.ran:  # sudo's check of the password ran it (setup_agent.sudo)
            return host.ran.pop(tuple(argv))
        code, out = host.root_run(argv)
        return code, host.scrub(out)

    root_ok = host.sudo_mode in ("root", "nopasswd", "password")
    return {"firewall": firewall_state(run, as_root if root_ok else None)}


def wheels_fact(host: FactHost) -> SetupFacts:
    return {"wheelhouse": _hashes(os.path.expanduser(host.cfg["wheelhouse"]),
                                  host.cfg.get("hash_only"))}


def hosts_fact(host: FactHost) -> SetupFacts:
    return {"hosts": _read("/etc/hosts")}


def workdir_fact(host: FactHost) -> SetupFacts:
    if not host.cfg.get("workdir"):
        return {}
    path = os.path.expanduser(host.cfg["workdir"])
    return {"workdir": {"path": path, "exists": os.path.isdir(path)}}


def env_fact(host: FactHost) -> SetupFacts:
    iface, why = route_interface(host.cfg["master_addr"])
    return {"env_file": _read(os.path.expanduser(host.cfg["env_file"])),
            "interface": iface or None, "interface_why": why}


def slurm_fact(host: FactHost) -> SetupFacts:
    """``setup --slurm``'s facts (``node.facts.slurm_facts``); the munge key's digest read as
    root."""
    def as_root(argv: list[str]) -> tuple[int, str]:
        code, out = host.root_run(argv)
        return code, host.scrub(out)

    try:
        import ctypes

        ctypes.CDLL(NVML_LIB)
        nvml = True
    except (ImportError, OSError):
        nvml = False
    root_ok = host.sudo_mode in ("root", "nopasswd", "password")
    return {"slurm": slurm_facts(run, as_root if root_ok else None, nvml)}


SECTIONS: dict[str, Fact] = {
    "apt": apt_fact, "venv": venv_fact, "key": key_fact, "os": os_fact,
    "firewall": firewall_fact, "wheels": wheels_fact, "hosts": hosts_fact,
    "workdir": workdir_fact, "env": env_fact, "slurm": slurm_fact,
}
"""Every fact section by the name a step asks for it (``setup.plan.StepDef.sections``; ``sudo``
is read with every ask: ``setup_agent.Node.facts``)."""
NO_ROOT = ("apt", "venv")
"""Sections that need no root and take time: read beside sudo's check of the password."""
BY_NAME = ("wheels", "slurm")
"""Sections read only when asked by name (hashing the wheels costs; Slurm's only for
``--slurm``), never with ``all``."""
ALIASES = {"pip": "venv"}


def sections(only: list[str] | None) -> list[str]:
    """The sections an ask names, in ``SECTIONS`` order (``None`` or ``all``: all but
    ``BY_NAME``)."""
    want = {ALIASES.get(name, name) for name in only or ["all"]}
    every = "all" in want
    return [name for name in SECTIONS
            if name in want or (every and name not in BY_NAME)]


def login_name() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _has_key(pubkey: str) -> bool:
    want = pubkey.split()[:2]
    text = _read(os.path.expanduser("~/.ssh/authorized_keys")) or ""
    return any(line.split()[:2] == want for line in text.splitlines() if line.strip())


def _os_release() -> OsRelease:
    out: dict[str, str] = {}
    for line in (_read("/etc/os-release") or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip().strip('"')
    return {"ID": out.get("ID", ""), "ID_LIKE": out.get("ID_LIKE", ""),
            "VERSION_ID": out.get("VERSION_ID", ""), "PRETTY_NAME": out.get("PRETTY_NAME", "")}


def _installed(packages: list[str]) -> dict[str, bool]:
    _, out = run(["dpkg-query", "-W", "-f", "${Package} ${Status}\n", *packages])
    done = {line.split()[0] for line in out.splitlines()
            if line.strip().endswith("ok installed")}
    return {p: p in done for p in packages}


def _gpu() -> SetupGpu:
    """NVIDIA GPUs: those on the PCI bus (there without a driver: what the driver step looks
    for), the driver and the compute capabilities, from the one discovery (``accel.gpus``)."""
    found = gpus()
    return {"count": max(pci_gpu_count(), int(found["count"])), "driver": found["driver"],
            "compute_capability": [c for c in found["compute_capability"] if c]}


VENV_DISTS = ("torch", "ptcluster", "pip", "scikit_learn")
"""The distributions whose versions the venv's facts report (named as `importlib.metadata`
normalizes them: scikit-learn is `scikit_learn`)."""


def _venv(path: str) -> Venv:
    """The venv at ``path``: whether it exists and works, its Python, and ``VENV_DISTS``."""
    py = os.path.join(path, "bin", "python")
    if not os.access(py, os.X_OK):
        return {"exists": False}
    return _venv_here(path, py) or _venv_probe(py)


def _venv_here(path: str, py: str) -> Venv | None:
    """The venv's facts without starting another interpreter, when its ``bin/python`` is the
    very interpreter running this program (``python3 -m venv`` makes it a symlink), so it runs
    and is this Python; None when only the interpreter can tell (``_venv_probe``).

    Its versions are read where ``importlib.metadata`` would find them: the ``Version`` in the
    ``METADATA`` of each ``NAME-VERSION.dist-info`` of the venv's site-packages, the one
    directory on its path (``_one_site`` says when that is not sure)."""
    cfg = _read(os.path.join(path, "pyvenv.cfg"))
    if os.path.realpath(py) != os.path.realpath(sys.executable) or cfg is None:
        return None
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    site = os.path.join(path, "lib", f"python{python}", "site-packages")
    try:
        entries = sorted(os.listdir(site))
    except OSError:
        return None
    if not _one_site(cfg, site, entries):
        return None
    dists: dict[str, str | None] = {d: None for d in VENV_DISTS}
    for entry in entries:
        name, sep, rest = entry.partition("-")
        key = re.sub(r"[-_.]+", "_", name).lower()
        if sep and rest.endswith(".dist-info") and key in dists and not dists[key]:
            meta = (_read(os.path.join(site, entry, "METADATA")) or "").split("\n\n", 1)[0]
            m = re.search(r"^Version:[ \t]*(\S+)", meta, re.M)
            dists[key] = m.group(1) if m else None
    return {"exists": True, "ok": True, "python": python, "dists": dists}


def _one_site(cfg: str, site: str, entries: list[str]) -> bool:
    """Whether the venv's distributions can only be in ``site``: not with the system's site
    packages (``include-system-site-packages``), nor ``PYTHONPATH``, nor an ``.egg-info``,
    nor a ``.pth`` line that adds a directory (``site`` runs lines that start with
    ``import`` and skips comments; every other line is a directory)."""
    if re.search(r"^\s*include-system-site-packages\s*=\s*true", cfg, re.M | re.I) or \
            os.environ.get("PYTHONPATH"):
        return False
    for entry in entries:
        if entry.endswith((".egg-info", ".egg-link")):
            return False
        if entry.endswith(".pth"):
            lines = (_read(os.path.join(site, entry)) or "unreadable").splitlines()
            if any(line.strip() and not line.startswith(("#", "import ", "import\t"))
                   for line in lines):
                return False
    return True


def _venv_probe(py: str) -> Venv:
    """The venv's facts from its own interpreter (one more Python start: ~60 ms of CPU)."""
    code, out = run([py, "-c", "import json,sys,importlib.metadata as m\n"
                     f"v={{}}\nfor d in {VENV_DISTS!r}:\n"
                     "  try: v[d]=m.version(d)\n  except Exception: v[d]=None\n"
                     "print(json.dumps({'python':'%d.%d'%sys.version_info[:2],'dists':v}))"])
    if code != 0:
        return {"exists": True, "ok": False, "why": out.strip()[-300:]}
    info = json.loads(out.strip().splitlines()[-1])
    return {"exists": True, "ok": True, **info}


def _hashes(folder: str, names: list[str] | None) -> dict[str, str]:
    """sha256 of the wheel files in ``folder`` (only ``names`` when given)."""
    out: dict[str, str] = {}
    try:
        entries = sorted(os.listdir(folder))
    except OSError:
        return out
    for name in entries:
        if not name.endswith(".whl") or (names is not None and name not in names):
            continue
        digest = hashlib.sha256()
        with open(os.path.join(folder, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[name] = digest.hexdigest()
    return out
