"""Setup's facts about a node's Slurm (``ptcluster setup --slurm``): its packages, its hardware as
``slurmd -C`` reports it, its cgroup version, NVML and GPU device files, the Slurm files there,
the munge key's digest, owner and mode (never its bytes), and the munge/Slurm services.

Standard library only; a part of setup's node program (shipped by ``remote.bootstrap``); the
caller gives the command runners (its own, and as root the way its node allows).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TypedDict

Runner = Callable[[list[str]], tuple[int, str]]
SLURM_PACKAGES = ("munge", "slurmd", "slurm-client", "slurmctld")
"""Debian/Ubuntu's names (slurm-wlm's parts); slurmctld is wanted on the controller only."""
SERVICES = ("munge", "slurmd", "slurmctld")
MUNGE_KEY = "/etc/munge/munge.key"
SLURM_FILES = {"slurm.conf": "/etc/slurm/slurm.conf", "gres.conf": "/etc/slurm/gres.conf",
               "cgroup.conf": "/etc/slurm/cgroup.conf"}
"""The files setup writes (Debian's slurm-wlm reads /etc/slurm since 20.11)."""
HW_KEYS = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore",
           "RealMemory")


def parse_slurmd_c(text: str) -> dict[str, int]:
    """``slurmd -C``'s first line (``NodeName=x CPUs=2 Boards=1 ... RealMemory=24105``) as
    {key: int} for ``HW_KEYS``."""
    out: dict[str, int] = {}
    for word in (text.strip().splitlines() or [""])[0].split():
        key, _, value = word.partition("=")
        if key in HW_KEYS and value.isdigit():
            out[key] = int(value)
    return out


def estimate_hw() -> dict[str, int]:
    """The node's hardware in ``slurmd -C``'s terms, read from /sys and /proc, for the plan of a
    node without slurmd yet (a dry run from nothing): what slurmd counts, online CPUs by their
    package and core ids, and MemTotal in MiB."""
    cpus = os.sysconf("SC_NPROCESSORS_ONLN")
    packages: set[str] = set()
    cores: set[tuple[str, str]] = set()
    base = "/sys/devices/system/cpu"
    for entry in os.listdir(base) if os.path.isdir(base) else []:
        if not re.fullmatch(r"cpu\d+", entry):
            continue
        pkg = _read(f"{base}/{entry}/topology/physical_package_id")
        core = _read(f"{base}/{entry}/topology/core_id")
        if pkg is not None and core is not None:
            packages.add(pkg.strip())
            cores.add((pkg.strip(), core.strip()))
    sockets = max(1, len(packages))
    per_socket = max(1, len(cores) // sockets) if cores else cpus
    threads = max(1, cpus // max(1, sockets * per_socket))
    mem = 0
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) // 1024
    return {"CPUs": cpus, "Boards": 1, "SocketsPerBoard": sockets, "CoresPerSocket": per_socket,
            "ThreadsPerCore": threads, "RealMemory": mem}


def cgroup_version() -> str:
    """``v2`` when /sys/fs/cgroup is the unified hierarchy alone (Ubuntu 22.04+, Debian 12 on
    metal), else ``v1`` (the legacy or hybrid layout: Slurm's cgroup plugins need v2's
    controllers delegated to it or v1's writable)."""
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) > 4 and fields[4] == "/sys/fs/cgroup":
            return "v2" if right.split()[:1] == ["cgroup2"] else "v1"
    return "v1"


def nvidia_devices() -> list[str]:
    """``/dev/nvidiaN`` files, in number order."""
    try:
        names = [n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n)]
    except OSError:
        return []
    return ["/dev/" + n for n in sorted(names, key=lambda n: int(n[6:]))]


class Service(TypedDict):
    """A munge or Slurm service as systemd says it."""

    enabled: bool
    active: bool
    since: int | None
    """When it became active (Unix time)."""


class MungeKey(TypedDict, total=False):
    """The munge key's digest, owner and mode (never its bytes); ``{exists: False}`` alone
    where there is none."""

    exists: bool
    owner: str
    mode: str
    """Octal, as ``stat -c %a`` says it."""
    sha256: str | None


class SlurmFacts(TypedDict):
    """Setup's ``slurm`` section (``SetupFacts.slurm``), as ``setup.slurm`` and
    ``setup.slurm_steps`` read it (``remote.replies.SLURM`` checks it)."""

    packages: dict[str, bool]
    """Each of ``SLURM_PACKAGES``: installed or not."""
    hw: dict[str, int]
    """``HW_KEYS``: ``slurmd -C``'s, or :func:`estimate_hw`'s."""
    hw_from: str
    """``slurmd -C`` or ``estimate``."""
    cgroup: str
    """``v1`` or ``v2``."""
    nvml: bool
    gpu_files: list[str]
    files: dict[str, str | None]
    """Each of ``SLURM_FILES``: its text, None where there is none."""
    mtimes: dict[str, int | None]
    munge_key: MungeKey | None
    """None where it cannot be read (no root)."""
    services: dict[str, Service]
    """Each of ``SERVICES``."""


def slurm_facts(run: Runner, as_root: Runner | None, nvml: bool) -> SlurmFacts:
    """The ``slurm`` section; ``munge_key`` None where it cannot be read (no root)."""
    _, out = run(["dpkg-query", "-W", "-f", "${Package} ${Status}\n", *SLURM_PACKAGES])
    done = {line.split()[0] for line in out.splitlines()
            if line.strip().endswith("ok installed")}
    hw: dict[str, int] = {}
    hw_from = "estimate"
    if "slurmd" in done:
        code, out = run(["slurmd", "-C"])
        hw = parse_slurmd_c(out) if code == 0 else {}
        hw_from = "slurmd -C" if len(hw) == len(HW_KEYS) else "estimate"
    if hw_from == "estimate":
        hw = estimate_hw()
    services: dict[str, Service] = {}
    for name in SERVICES:
        _, enabled = run(["systemctl", "is-enabled", name])
        _, shown = run(["systemctl", "show", "--timestamp=unix", "-p", "ActiveState",
                        "-p", "ActiveEnterTimestamp", name])
        props = dict(line.partition("=")[::2] for line in shown.splitlines())
        since = props.get("ActiveEnterTimestamp", "").lstrip("@")
        services[name] = {"enabled": enabled.strip() == "enabled",
                          "active": props.get("ActiveState") == "active",
                          "since": int(since) if since.isdigit() else None}
    files = {name: _read(path) for name, path in SLURM_FILES.items()}
    mtimes = {name: _file_mtime(path) for name, path in SLURM_FILES.items()}
    return {"packages": {p: p in done for p in SLURM_PACKAGES}, "hw": hw, "hw_from": hw_from,
            "cgroup": cgroup_version(), "nvml": nvml, "gpu_files": nvidia_devices(),
            "files": files, "mtimes": mtimes, "munge_key": _munge_key(as_root),
            "services": services}


def _munge_key(as_root: Runner | None) -> MungeKey | None:
    """The key's sha256, owner and mode (read as root: the file is the munge user's alone);
    ``{"exists": False}`` when there is none."""
    if as_root is None:
        return None
    code, out = as_root(["stat", "-c", "%U %a", MUNGE_KEY])
    if code != 0:
        return {"exists": False}
    owner, mode = (out.split() + ["", ""])[:2]
    code, digest = as_root(["sha256sum", MUNGE_KEY])
    return {"exists": True, "owner": owner, "mode": mode,
            "sha256": digest.split()[0] if code == 0 and digest.split() else None}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _file_mtime(path: str) -> int | None:
    try:
        return int(os.stat(path).st_mtime)
    except OSError:
        return None
