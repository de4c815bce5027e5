"""The node side of ``ptcluster setup``: read-only facts, and commands run on the head's word.

Shipped like the doctor's probe (source over the channel's stdin, ``remote.bootstrap``) and run
by the node's system ``python3``: standard library only, nothing of ptcluster installed.

  stdin  line 2   JSON config: pubkey, venv, wheelhouse, env_file, packages, master_addr
  stdin           ``sudo {"password": ...}``   kept in memory only, piped to ``sudo -S``
                  ``facts {"only": [...]}``    -> ``facts {...}``
                  ``run {"id", "argv", "root", "input", "timeout"}`` -> ``done {"id", "rc", "out"}``
                  ``bye``: exit once what was asked is done; ``stop`` or EOF: end the
                  running command (its process group) and exit

The password never reaches a command line, an environment, a file or a frame sent back: it is
written to ``sudo -S``'s stdin and scrubbed from any output returned.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from typing import Any

from ptcluster.node.leases import LEASE_DIR  # inlined
from ptcluster.node.netif import route_interface  # inlined
from ptcluster.node.wire import control, encode, hello, split  # inlined

C_ENV = {"LC_ALL": "C", "LANG": "C"}
"""Commands whose words we look at run in the C locale."""


RUNNING: set[subprocess.Popen[str]] = set()
"""Commands running now: ended with the channel (see ``main``)."""
STOPPING = threading.Event()
"""Set when the head said stop or went away: no command starts any more."""


def run(argv: list[str], *, stdin: str | None = None, timeout: float = 30.0,
        env: dict[str, str] | None = None) -> tuple[int, str]:
    if shutil.which(argv[0]) is None and not os.path.isabs(argv[0]):
        return 127, f"{argv[0]}: not installed"
    if STOPPING.is_set():
        return 130, f"{argv[0]}: not started, setup was stopped"
    try:
        # its own process group, so that the whole command (sudo, apt, dpkg...) can be ended
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             env={**os.environ, **C_ENV, **(env or {})})
    except OSError as exc:
        return 126, f"{argv[0]}: {exc}"
    RUNNING.add(p)
    if STOPPING.is_set():  # stopped while it was being started: main may have missed it
        end(p)
    try:
        out, _ = p.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        end(p)
        return 124, f"{argv[0]}: timed out after {timeout:.0f} s"
    finally:
        RUNNING.discard(p)
    return p.returncode, out


def end(p: subprocess.Popen[str]) -> None:
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


class Node:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.password: str | None = None
        self.sudo_mode: str | None = None
        self.sudo_facts: dict[str, Any] | None = None
        self.ran: dict[tuple[str, ...], tuple[int, str]] = {}
        """What the password's check ran as root besides ``true`` (see ``sudo``), kept for
        the fact that needs it in the same ``facts`` call."""

    # -- sudo ---------------------------------------------------------------------------------
    def sudo(self, check: tuple[str, ...] = ("true",)) -> dict[str, Any]:
        """root | nopasswd | password | needs-password | wrong-password | none (+ why).

        The password is checked by running ``check`` as root: a command whose output a fact
        needs anyway (ufw's rules) saves a second password check (sudo's hashing of it is
        ~60 ms of CPU); its result waits in ``ran``. Should it fail, ``true`` tells why."""
        if os.geteuid() == 0:
            return {"mode": "root"}
        if shutil.which("sudo") is None:
            return {"mode": "none", "why": "sudo is not installed"}
        code, out = run(["sudo", "-n", "true"])
        if code == 0:
            return {"mode": "nopasswd"}
        if self.password is None:
            return {"mode": "needs-password"}
        code, out = run(["sudo", "-k", "-S", "-p", "", "--", *check],
                        stdin=self.password + "\n")
        out = self.scrub(out)
        if code == 0:
            if check != ("true",):
                self.ran[check] = (code, out)
            return {"mode": "password"}
        low = out.lower()
        if "incorrect password" in low or "sorry, try again" in low:
            return {"mode": "wrong-password", "why": "sudo refused the password"}
        if check != ("true",):  # another refusal, or the command failed: the plain check says
            return self.sudo()
        return {"mode": "none", "why": out.strip().splitlines()[-1].rstrip(".") if out.strip()
                else f"sudo exit status {code}"}

    def root_argv(self, argv: list[str], data: str | None) -> tuple[list[str], str | None]:
        """``argv`` run as root the way this node allows, and its stdin."""
        mode = self.sudo_mode or self.sudo()["mode"]
        self.sudo_mode = mode
        if mode == "root":
            return argv, data
        if mode == "nopasswd":
            return ["sudo", "-n", "--", *argv], data
        if mode == "password" and self.password is not None:
            # sudo -S reads the first line, the command gets the rest. -k: sudo must ask (and
            # so read that line) every time; with a cached credential it would not, and the
            # password would become the command's input.
            return (["sudo", "-k", "-S", "-p", "", "--", *argv],
                    self.password + "\n" + (data or ""))
        raise PermissionError(f"no root on this node (sudo: {mode})")

    def scrub(self, text: str) -> str:
        if self.password:
            text = text.replace(self.password, "***")
        return text

    # -- facts --------------------------------------------------------------------------------
    def facts(self, only: list[str] | None) -> dict[str, Any]:
        want = set(only or ["all"])
        every = "all" in want
        out: dict[str, Any] = {"user": _user(), "uid": os.geteuid(),
                               "home": os.path.expanduser("~"), "hostname": os.uname()[1],
                               "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
                               "python_path": sys.executable}
        # what needs no root runs beside sudo's check of the password
        slow: list[threading.Thread] = []
        if every or "apt" in want:
            slow.append(threading.Thread(target=lambda: out.__setitem__(
                "packages", _installed(self.cfg["packages"]))))
        if every or "venv" in want or "pip" in want:
            slow.append(threading.Thread(target=lambda: out.__setitem__(
                "venv", _venv(os.path.expanduser(self.cfg["venv"])))))
        for t in slow:
            t.start()
        firewall = every or "firewall" in want
        if self.sudo_facts is None:  # once per password (sudo is slow to ask)
            self.sudo_facts = self.sudo(UFW_ADDED if firewall and _ufw_enabled() else ("true",))
        sudo = self.sudo_facts
        self.sudo_mode = sudo["mode"]
        out["sudo"] = sudo
        if every or "key" in want:
            out["key_authorized"] = _has_key(self.cfg["pubkey"])
        if every or "os" in want:
            out["os"] = _os_release()
            out["gpu"] = _gpu()
        if firewall:
            out["firewall"] = self.firewall(sudo["mode"] in ("root", "nopasswd", "password"))
        if "wheels" in want:  # hashing the wheels costs: only when asked by name
            out["wheelhouse"] = _hashes(os.path.expanduser(self.cfg["wheelhouse"]),
                                        self.cfg.get("hash_only"))
        if every or "hosts" in want:
            out["hosts"] = _read("/etc/hosts")
        if (every or "workdir" in want) and self.cfg.get("workdir"):
            path = os.path.expanduser(self.cfg["workdir"])
            out["workdir"] = {"path": path, "exists": os.path.isdir(path)}
        if every or "leases" in want:
            out["leases"] = {"dir": LEASE_DIR, "tmpfiles": _read(TMPFILES)}
            try:
                st = os.lstat(LEASE_DIR)
                out["leases"].update(exists=True, mode=st.st_mode, uid=st.st_uid)
            except OSError:
                out["leases"]["exists"] = False
        if every or "env" in want:
            out["env_file"] = _read(os.path.expanduser(self.cfg["env_file"]))
            iface, why = route_interface(self.cfg["master_addr"])
            out["interface"] = iface or None
            out["interface_why"] = why
        for t in slow:
            t.join()
        self.ran.clear()
        return out

    def firewall(self, root_ok: bool) -> dict[str, Any]:
        """ufw (or firewalld): installed, active, and our rules (``ufw show added``)."""
        if _ufw_installed():
            enabled = _ufw_enabled()
            if not root_ok:
                return {"kind": "ufw", "active": enabled, "rules": None,
                        "why": "reading ufw's rules needs root"}
            if not enabled:
                return {"kind": "ufw", "active": False, "rules": []}
            argv, data = self.root_argv(list(UFW_ADDED), None)
            code, added = self.ran.pop(UFW_ADDED) if UFW_ADDED in self.ran else run(
                argv, stdin=data)
            rules = [line.strip() for line in added.splitlines() if line.startswith("ufw ")]
            return {"kind": "ufw", "active": enabled, "rules": rules if code == 0 else None,
                    "why": "" if code == 0 else self.scrub(added.strip())[-200:]}
        if shutil.which("firewall-cmd"):
            code, out = run(["firewall-cmd", "--state"])
            active = code == 0 and "running" in out
            sources: list[str] | None = None
            if active and root_ok:
                argv, data = self.root_argv(
                    ["firewall-cmd", "--zone=trusted", "--list-sources"], None)
                _, listed = run(argv, stdin=data)
                sources = listed.split()
            return {"kind": "firewalld", "active": active, "rules": sources}
        return {"kind": None, "active": False, "rules": []}

    # -- commands -----------------------------------------------------------------------------
    def run_step(self, msg: dict[str, Any]) -> dict[str, Any]:
        argv = [os.path.expanduser(a) if a.startswith("~/") else a for a in msg["argv"]]
        data = msg.get("input")
        if msg.get("root"):
            try:
                argv, data = self.root_argv(argv, data)
            except PermissionError as exc:
                return {"id": msg["id"], "rc": 1, "out": str(exc)}
        code, out = run(argv, stdin=data, timeout=float(msg.get("timeout", 600)),
                        env=msg.get("env"))
        return {"id": msg["id"], "rc": code, "out": self.scrub(out)[-4000:]}


UFW_ADDED = ("ufw", "show", "added")
"""ufw's rules as its own command syntax: one call (ufw is slow to start)."""


def _ufw_installed() -> bool:
    return bool(shutil.which("ufw")) or os.path.exists("/usr/sbin/ufw")


def _ufw_enabled() -> bool:
    conf = _read("/etc/ufw/ufw.conf") or ""
    return _ufw_installed() and bool(re.search(r"^\s*ENABLED\s*=\s*yes", conf, re.M))


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


TMPFILES = "/etc/tmpfiles.d/ptcluster.conf"
"""systemd-tmpfiles' entry that makes the lease directory at every boot (/run is a tmpfs)."""


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


def _os_release() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (_read("/etc/os-release") or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip().strip('"')
    return {k: out.get(k, "") for k in ("ID", "ID_LIKE", "VERSION_ID", "PRETTY_NAME")}


def _installed(packages: list[str]) -> dict[str, bool]:
    _, out = run(["dpkg-query", "-W", "-f", "${Package} ${Status}\n", *packages])
    done = {line.split()[0] for line in out.splitlines()
            if line.strip().endswith("ok installed")}
    return {p: p in done for p in packages}


def _gpu() -> dict[str, Any]:
    """NVIDIA GPUs (PCI), the driver (kernel module, then /proc, then nvidia-smi) and the
    compute capabilities nvidia-smi reports."""
    count = 0
    base = "/sys/bus/pci/devices"
    for dev in os.listdir(base) if os.path.isdir(base) else []:
        vendor = (_read(os.path.join(base, dev, "vendor")) or "").strip()
        klass = (_read(os.path.join(base, dev, "class")) or "").strip()
        if vendor == "0x10de" and klass.startswith("0x03"):
            count += 1
    driver = (_read("/sys/module/nvidia/version") or "").strip() or None
    if driver is None:
        m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9.]+)",
                      _read("/proc/driver/nvidia/version") or "")
        driver = m.group(1) if m else None
    caps: list[str] = []
    code, out = run(["nvidia-smi", "--query-gpu=driver_version,compute_cap",
                     "--format=csv,noheader"], timeout=20)
    if code == 0:
        for line in out.strip().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2:
                driver = driver or parts[0]
                caps.append(parts[1])
        count = max(count, len(caps))
    return {"count": count, "driver": driver, "compute_capability": caps}


VENV_DISTS = ("torch", "ptcluster", "pip")
"""The distributions whose versions the venv's facts report."""


def _venv(path: str) -> dict[str, Any]:
    """The venv at ``path``: whether it exists and works, its Python, and ``VENV_DISTS``."""
    py = os.path.join(path, "bin", "python")
    if not os.access(py, os.X_OK):
        return {"exists": False}
    return _venv_here(path, py) or _venv_probe(py)


def _venv_here(path: str, py: str) -> dict[str, Any] | None:
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


def _venv_probe(py: str) -> dict[str, Any]:
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


def main() -> None:
    stdin = sys.stdin.buffer
    cfg = json.loads(stdin.readline())
    out = sys.stdout.buffer
    node = Node(cfg)

    def send(kind: str, payload: dict[str, Any]) -> None:
        out.write(encode(kind, payload))
        out.flush()

    out.write(hello("setup"))
    out.flush()
    # Requests are served on a worker thread, so that this thread sees the channel end (EOF:
    # the head went away, Ctrl-C there) even while a command runs, and ends that command:
    # every step can be re-run, so a re-run brings the node to the same end state.
    import queue

    requests: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()

    def serve() -> None:
        while True:
            item = requests.get()
            if item is None:
                return
            kind, msg = item
            try:
                if kind == "facts":
                    if "hash_only" in msg:
                        node.cfg["hash_only"] = msg["hash_only"]
                    send("facts", node.facts(msg.get("only")))
                elif kind == "run":
                    send("done", node.run_step(msg))
            except OSError:  # the head is gone
                return

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    for raw in iter(stdin.readline, b""):
        kind, payload = split(raw.decode().rstrip("\n"))
        if kind == "bye":  # what was asked is finished first
            requests.put(None)
            worker.join()
            os._exit(0)
        if kind == "stop":
            break
        if kind == "hb":
            continue
        msg = control(payload)
        if kind == "sudo":
            node.password = msg.get("password")
            node.sudo_mode = node.sudo_facts = None
        elif kind in ("facts", "run"):
            requests.put((kind, msg))
    # stop, or EOF: the head was interrupted (Ctrl-C) or is gone
    STOPPING.set()  # first: a command being started now ends itself (see run)
    for p in list(RUNNING):
        end(p)
    requests.put(None)
    worker.join(timeout=15)  # what is queued returns at once; one being started is ended
    os._exit(0)


if __name__ == "__main__":
    main()
