"""The head's wheelhouse: every wheel the nodes install, downloaded once on the head.

Nodes install with ``pip install --no-index --find-links`` from their own copy, so a cluster
whose nodes cannot reach a package index (air-gapped, or behind a proxy only the head has) is
the normal case, and each wheel crosses the network once per node at most.

ptcluster itself is packed from the head's installed copy into a pure-Python wheel (standard
zip format, fixed timestamps, so the same code always gives the same bytes and checksum). Its
version carries a hash of the code (``0.1.0+g1a2b3c4d``): a node with other code is upgraded.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import ptcluster
from ptcluster.errors import PtclusterError
from ptcluster.setup.torch_choice import TorchChoice

DEFAULT_WHEELHOUSE = "~/.cache/ptcluster/wheelhouse"


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
    metadata = "\n".join(["Metadata-Version: 2.1", "Name: ptcluster", f"Version: {version}",
                          "Requires-Python: >=3.10",
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


def download_command(folder: Path, torch: TorchChoice, self_wheel: Path) -> list[str]:
    """The head's ``pip download`` of torch (the chosen build) and ptcluster's dependencies.

    PyTorch's index for the build comes first; pip's own configuration (``PIP_INDEX_URL``,
    ``PIP_NO_INDEX``, ``PIP_FIND_LINKS``, pip.conf) still applies, for mirrors.
    """
    return [sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
            "--dest", str(folder), "--only-binary=:all:", "--extra-index-url", torch.index_url,
            torch.requirement, str(self_wheel)]


def prepare_wheelhouse(root: Path, torch: TorchChoice, timeout: float = 3600) -> tuple[
        Path, SelfWheel, dict[str, str]]:
    """Download (once) every wheel the nodes need into ``root/<torch build>``; returns the
    folder, ptcluster's wheel, and {file name: sha256} of every wheel in it."""
    folder = root.expanduser() / torch.local_version
    self_wheel = build_self_wheel(folder)
    stale = [p for p in folder.glob("ptcluster-*.whl") if p != self_wheel.path]
    for old in stale:  # older code of ours: the nodes must not pick it
        old.unlink()
    argv = download_command(folder, torch, self_wheel.path)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise PtclusterError(f"the head could not download the wheels for the nodes "
                             f"({' / '.join(tail)})",
                             "check the head's access to PyPI and download.pytorch.org, or "
                             "point pip at a mirror (PIP_INDEX_URL / PIP_FIND_LINKS)")
    return folder, self_wheel, manifest(folder)


def manifest(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.glob("*.whl")):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[path.name] = digest.hexdigest()
    return out
