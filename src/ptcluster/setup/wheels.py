"""The head's wheelhouse: every wheel the nodes install, downloaded once on the head.

Nodes install with ``pip install --no-index --find-links`` from their own copy, so a cluster
whose nodes cannot reach a package index (air-gapped, or behind a proxy only the head has) is
the normal case, and each wheel crosses the network once per node at most.

ptcluster itself is packed from the head's installed copy into a pure-Python wheel (standard
zip format, fixed timestamps, so the same code always gives the same bytes and checksum). Its
version carries a hash of the code (``0.1.0+g1a2b3c4d``): a node with other code is upgraded.
The nodes get it with ``SELF_EXTRAS``: what the jobs the docs give after setup need there.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ptcluster
from ptcluster.errors import PtclusterError
from ptcluster.setup.torch_choice import TorchChoice

DEFAULT_WHEELHOUSE = "~/.cache/ptcluster/wheelhouse"
SELF_EXTRAS = ("digits",)
"""ptcluster's extras the nodes get with it. ``digits`` (scikit-learn): the reference trainer's
offline data set, the one it trains on where MNIST cannot be downloaded; getting started's job
after setup (``run -m ptcluster.examples.mnist``) needs it on nodes without a package index,
which are the case the wheelhouse is for. Measured (scikit-learn 1.9.1, CPython 3.11, x86-64):
it adds scikit-learn 9.3 MB, SciPy 35.3 MB and four small ones (joblib, threadpoolctl, narwhals,
cloudpickle) to the wheelhouse, 45.5 MB beside 222 MB for torch's CPU build and the rest (NumPy
was there already); on the bare testbed setup's install step went from 20.4-20.9 s to
27.3-29.1 s per node (tests/testbed/test_setup.py, one run each)."""
EXTRA_DISTS = {"scikit_learn": "scikit-learn"}
"""What ``SELF_EXTRAS`` bring, as a node's venv facts name it -> as setup's plan says it; any
version will do (pip picks it: the head does not know which before its download)."""
PROGRESS_EVERY = 15.0
"""Seconds between the download's progress notes (what is in the folder so far)."""


@dataclass(frozen=True)
class SelfWheel:
    path: Path
    version: str


def _package_files() -> list[tuple[str, Path]]:
    root = Path(ptcluster.__file__).resolve().parent
    files = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files.append((f"ptcluster/{path.relative_to(root).as_posix()}", path))
    return files


def code_hash() -> str:
    digest = hashlib.sha256()
    for name, path in _package_files():
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:8]


def self_requirement(version: str) -> str:
    """What the nodes' pip installs of ours: ``ptcluster[digits]==VERSION``."""
    return f"ptcluster[{','.join(SELF_EXTRAS)}]=={version}"


def venv_lacks(dists: dict[str, str | None], wanted: dict[str, str]) -> list[str]:
    """What a node's venv (its facts' ``dists``) lacks, as setup's plan says it: ``torch
    2.12.0`` (not the ``wanted`` version), ``ptcluster missing``, ``scikit-learn missing``
    (``EXTRA_DISTS``: any version)."""
    return [f"{k} {dists.get(k) or 'missing'}" for k, v in wanted.items() if dists.get(k) != v] \
        + [f"{said} missing" for name, said in EXTRA_DISTS.items() if not dists.get(name)]


def extras_said(dists: dict[str, str | None]) -> str:
    """``, scikit-learn 1.9.1``: the ``EXTRA_DISTS`` a venv has, for setup's plan."""
    return "".join(f", {said} {dists[name]}" for name, said in EXTRA_DISTS.items()
                   if dists.get(name))


def self_version() -> str:
    """The version the nodes get: the head's, plus a hash of its code."""
    return f"{ptcluster.__version__.split('+')[0]}+g{code_hash()}"


def build_self_wheel(dest: Path) -> SelfWheel:
    """Pack the head's ptcluster into ``dest`` (kept when an identical one is there)."""
    version = self_version()
    name = f"ptcluster-{version}-py3-none-any.whl"
    path = dest / name
    if path.exists():
        return SelfWheel(path, version)
    dest.mkdir(parents=True, exist_ok=True)
    dist_info = f"ptcluster-{version}.dist-info"
    requires = importlib.metadata.requires("ptcluster") or []
    # pip installs an extra's requirements only when the wheel says it provides that extra
    extras = sorted({*SELF_EXTRAS, *(importlib.metadata.metadata("ptcluster").get_all(
        "Provides-Extra") or [])})
    metadata = "\n".join(["Metadata-Version: 2.1", "Name: ptcluster", f"Version: {version}",
                          "Requires-Python: >=3.10",
                          *[f"Provides-Extra: {e}" for e in extras],
                          *[f"Requires-Dist: {r}" for r in requires]]) + "\n"
    entry = "[console_scripts]\nptcluster = ptcluster.cli:main\n"
    wheel_meta = ("Wheel-Version: 1.0\nGenerator: ptcluster\nRoot-Is-Purelib: true\n"
                  "Tag: py3-none-any\n")
    members = [(n, p.read_bytes()) for n, p in _package_files()]
    members += [(f"{dist_info}/METADATA", metadata.encode()),
                (f"{dist_info}/WHEEL", wheel_meta.encode()),
                (f"{dist_info}/entry_points.txt", entry.encode())]
    record = []
    for n, data in members:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{n},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    members.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode()))
    tmp = path.with_suffix(".part")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, data in members:
            info = zipfile.ZipInfo(n, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    os.replace(tmp, path)
    return SelfWheel(path, version)


def download_commands(folder: Path, torch: TorchChoice, self_wheel: Path,
                      pins: Path) -> tuple[list[str], list[str]]:
    """The head's two ``pip download``s (L8): torch (the chosen build) and its dependencies
    from PyTorch's index alone (``--index-url``: never merged with another index, so a name
    of that index that someone registers on PyPI with a higher version, as torchtriton was,
    is not picked); then ptcluster's dependencies (with ``SELF_EXTRAS``) from pip's own
    configuration (PyPI, ``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, pip.conf), with everything
    the first one got pinned (``pins``: :func:`pin_text`) and found in ``folder``.
    ``PIP_NO_INDEX`` and ``PIP_FIND_LINKS`` apply to both (an offline wheelhouse)."""
    base = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
            "--dest", str(folder), "--only-binary=:all:"]
    return ([*base, "--index-url", torch.index_url, torch.requirement],
            [*base, "--find-links", str(folder), "--constraint", str(pins), torch.requirement,
             f"{self_wheel}[{','.join(SELF_EXTRAS)}]"])


def pin_text(folder: Path) -> str:
    """pip's constraints: ``name==version`` of every wheel in ``folder`` but ptcluster's own
    (the wheel file name's first two parts); a name with several versions there (earlier
    setups') is kept within them."""
    found: dict[str, set[str]] = {}
    for path in folder.glob("*.whl"):
        name, version = path.name.split("-")[:2]
        if name.lower() != "ptcluster":
            found.setdefault(name.lower().replace("_", "-"), set()).add(version)
    lines = []
    for name, versions in sorted(found.items()):
        ordered = sorted(versions, key=_version_key)
        lines.append(f"{name}=={ordered[0]}" if len(ordered) == 1 else  # (earlier setups')
                     f"{name}>={ordered[0].split('+')[0]},<={ordered[-1].split('+')[0]}")
    return "".join(line + "\n" for line in lines)


def _version_key(version: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(p), "") if p.isdigit() else (-1, p)
                 for p in version.replace("+", ".").split("."))


def sources(torch: TorchChoice, env: dict[str, str] | None = None) -> str:
    """Where the download comes from, as pip will see it (its environment variables; a
    pip.conf is pip's to read, and named only as a possibility)."""
    env = dict(os.environ) if env is None else env
    if env.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on"):
        said = ["no index (PIP_NO_INDEX)"]
    else:
        said = [f"torch's from {torch.index_url} alone, the rest from "
                + (env.get("PIP_INDEX_URL") or "PyPI (or pip.conf's index)")]
    said += [f"{link} (PIP_FIND_LINKS)" for link in env.get("PIP_FIND_LINKS", "").split()]
    return ", ".join(said)


def folder_size(folder: Path) -> tuple[int, int]:
    """(wheels, bytes) in ``folder``."""
    sizes = [p.stat().st_size for p in folder.glob("*.whl")]
    return len(sizes), sum(sizes)


def megabytes(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size >= 10e6 else f"{size / 1e6:.1f} MB"


def prepare_wheelhouse(root: Path, torch: TorchChoice, timeout: float = 3600,
                       say: Callable[[str], None] | None = None) -> tuple[
        Path, SelfWheel, dict[str, str]]:
    """Download (once) every wheel the nodes need into ``root/<torch build>``; returns the
    folder, ptcluster's wheel, and {file name: sha256} of every wheel in it. ``say`` gets
    what it does: the download (what, from where), its progress every ``PROGRESS_EVERY``
    seconds, and what the folder holds at the end (pip's own output is not read: its words are
    not an interface)."""
    say = say or (lambda text: None)
    folder = root.expanduser() / torch.local_version
    self_wheel = build_self_wheel(folder)
    stale = [p for p in folder.glob("ptcluster-*.whl") if p != self_wheel.path]
    for old in stale:  # older code of ours: the nodes must not pick it
        old.unlink()
    had, had_bytes = folder_size(folder)
    say(f"downloading {torch.requirement} and {self_requirement(self_wheel.version)}'s "
        f"dependencies into {folder} ({had} wheel(s) there already, ptcluster's own included), "
        f"from {sources(torch)}")
    begun = time.monotonic()
    download(folder, torch, self_wheel.path, timeout, say)
    count, size = folder_size(folder)
    say(f"{count} wheel(s), {megabytes(size)} ({count - had} new, "
        f"{megabytes(max(0, size - had_bytes))}) in {time.monotonic() - begun:.1f} s")
    return folder, self_wheel, manifest(folder)


def download(folder: Path, torch: TorchChoice, self_wheel: Path, timeout: float,
             say: Callable[[str], None]) -> None:
    """:func:`download_commands` run, the pins of the first written for the second."""
    begun = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ptcluster-pins-") as private:
        pins = Path(private) / "constraints.txt"
        for i, argv in enumerate(download_commands(folder, torch, self_wheel, pins)):
            pins.write_text(pin_text(folder) if i else "")
            proc = _pip(argv, timeout, lambda: say(
                "pip still at work (it resolves every package first, then writes the wheels): "
                "{} wheel(s), {} in the folder so far ({:.0f} s)".format(
                    *_sized(folder), time.monotonic() - begun)))
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                raise PtclusterError(f"the head could not download the wheels for the nodes "
                                     f"({' / '.join(tail)})",
                                     "check the head's access to PyPI and download.pytorch.org, "
                                     "or point pip at a mirror (PIP_INDEX_URL / PIP_FIND_LINKS)")


def _sized(folder: Path) -> tuple[int, str]:
    count, size = folder_size(folder)
    return count, megabytes(size)


def _pip(argv: list[str], timeout: float,
         progress: Callable[[], None]) -> subprocess.CompletedProcess[str]:
    """Run pip (its output kept for an error), calling ``progress`` every ``PROGRESS_EVERY``
    seconds while it runs."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        deadline = time.monotonic() + timeout
        while True:
            try:
                out, err = p.communicate(timeout=min(PROGRESS_EVERY,
                                                     max(0.1, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    p.kill()
                    raise
                progress()
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def manifest(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.glob("*.whl")):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[path.name] = digest.hexdigest()
    return out
