"""Real wheels made here, for the environment's tests: a zip with the package's files, METADATA,
WHEEL and RECORD (what pip and uv read), written with the standard library."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest


def make_wheel(dest: Path, name: str, version: str, *, requires: Sequence[str] = (),
               files: dict[str, str] | None = None, tag: str = "py3-none-any") -> Path:
    """``dest/<name>-<version>-<tag>.whl``: a module ``<name>`` whose ``VERSION`` is
    ``version`` (plus ``files``), depending on ``requires``. Same inputs, same bytes."""
    dist = name.replace("-", "_")
    module = {f"{dist}/__init__.py": f"VERSION = {version!r}\n"}
    members = {**module, **(files or {})}
    info = f"{dist}-{version}.dist-info"
    members[f"{info}/METADATA"] = "\n".join(
        ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
         *[f"Requires-Dist: {r}" for r in requires]]) + "\n"
    members[f"{info}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: ptcluster-tests\n"
                                f"Root-Is-Purelib: true\nTag: {tag}\n")
    record = []
    for arc, text in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{arc},sha256={digest.decode()},{len(text.encode())}")
    members[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for arc, text in members.items():
            zi = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
            zi.external_attr = 0o644 << 16
            zf.writestr(zi, text)
    return path


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def uv_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the head's own uv packed as a wheel (made once per module): the tool
    the environment needs, for a ``--find-links`` folder with no index to fetch it from."""
    from ptcluster.venvs.tools import pack_installed_uv
    folder = tmp_path_factory.mktemp("uv")
    assert pack_installed_uv(folder) is not None
    return folder
