"""Real wheels for the environment's tests: a zip with the module, METADATA, WHEEL and RECORD
(what uv and pip install), and a ``ResolvedEnv`` of them without env-A's resolver."""

from __future__ import annotations

import base64
import glob
import hashlib
import os
import sys
import zipfile
from pathlib import Path

from ptcluster.venvs.resolved import Platform, ResolvedEnv, Wheel


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"=").decode()


def make_wheel(folder: Path, name: str, version: str, source: str | None = None,
               padding: int = 0) -> Path:
    """``name-version-py3-none-any.whl`` in ``folder`` with one module ``name`` (its source:
    ``VERSION = "version"`` unless given; ``padding`` bytes of incompressible data beside it)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": (source or f'VERSION = "{version}"\n').encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n"
                            .encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: ptcluster-tests\nRoot-Is-Purelib: "
                         b"true\nTag: py3-none-any\n",
    }
    if padding:
        files[f"{name}/blob.bin"] = os.urandom(padding)
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    record += f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files.items():
            z.writestr(arc, data)
        z.writestr(f"{dist}/RECORD", record)
    return path


def wheel_of(path: Path, name: str, version: str) -> Wheel:
    data = path.read_bytes()
    return Wheel(name, version, path.name, hashlib.sha256(data).hexdigest(), len(data))


def uv_wheel() -> Path | None:
    """A uv wheel for this machine, where one is at hand ($PTC_UV_WHEEL, the testbed's cache)."""
    found = [os.environ.get("PTC_UV_WHEEL", ""),
             *sorted(glob.glob("/var/cache/ptcluster-testbed/wheels/uv-*manylinux*x86_64*.whl")),
             *sorted(glob.glob("/tmp/uvdl/uv-*manylinux*x86_64*.whl"))]
    return next((Path(p) for p in found if p and os.path.isfile(p)), None)


def this_platform(python: str | None = None) -> Platform:
    import platform

    libc, version = platform.libc_ver()
    return Platform(python or f"{sys.version_info[0]}.{sys.version_info[1]}",
                    platform.machine(), version if libc == "glibc" else "")


def resolved(wheels: dict[Wheel, Path], uv: Path | None, python: str | None = None,
             source: str = "requirements.txt") -> ResolvedEnv:
    tools = (wheel_of(uv, "uv", uv.name.split("-")[1]),) if uv is not None else ()
    return ResolvedEnv(source, "requirements", this_platform(python),
                       tuple(sorted(wheels, key=lambda w: w.name)), tools)


def slow_tool_wheel(folder: Path, script: str) -> Wheel:
    """A wheel named uv whose ``uv`` script is ``script`` (a stand-in that misbehaves)."""
    dist = "uv-0.0.1"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.data/scripts/uv", script)
        z.writestr(f"{dist}.dist-info/METADATA", "Metadata-Version: 2.1\nName: uv\n"
                   "Version: 0.0.1\n\n")
    return wheel_of(path, "uv", "0.0.1")
