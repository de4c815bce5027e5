"""The head's content-addressed wheel store (default ``~/.cache/ptcluster/wheels/``).

Every wheel a project's environment ships is kept once, by its sha256: ``sha256/<hex>`` holds
the bytes, ``sha256/<hex>.json`` what the file is (name, version, real file name, size), so a
wheel is found by its digest whatever folder or download it came from. Setup's wheelhouse
(``~/.cache/ptcluster/wheelhouse``) keeps its own meaning: the wheels of setup's venv.

A file enters by a copy to a temporary name in the store's folder, renamed into place once its
digest is known, so a crash never leaves a partial file under a digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from ptcluster.errors import UsageError
from ptcluster.venvs.resolved import Wheel, normalize

DEFAULT_STORE = "~/.cache/ptcluster/wheels"
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    """Hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_of(path: Path, sha256: str, size: int) -> Wheel:
    """The :class:`Wheel` a file named like a wheel is (its name and version from the name)."""
    try:
        name, version, _build, _tags = parse_wheel_filename(path.name)
    except InvalidWheelFilename as exc:
        raise UsageError(f"{path}: not a wheel's file name ({exc})",
                         "a wheel is NAME-VERSION(-BUILD)-PY-ABI-PLATFORM.whl") from None
    return Wheel(name=normalize(str(name)), version=str(version), filename=path.name,
                 sha256=sha256, size=size)


class WheelStore:
    """Wheels by digest under ``root`` (created on first use, private to this user)."""

    def __init__(self, root: Path | str = DEFAULT_STORE) -> None:
        self.root = Path(root).expanduser()

    @property
    def _dir(self) -> Path:
        return self.root / "sha256"

    def path(self, wheel: Wheel) -> Path:
        """Where the stored file of ``wheel`` lies (it must be stored: ``has``)."""
        return self._dir / wheel.sha256

    def has(self, sha256: str) -> bool:
        return (self._dir / sha256).is_file() and (self._dir / f"{sha256}.json").is_file()

    def get(self, sha256: str) -> Wheel | None:
        """The stored wheel with this digest, or None."""
        if not self.has(sha256):
            return None
        return Wheel.from_json(json.loads((self._dir / f"{sha256}.json").read_text()))

    def add(self, path: Path) -> Wheel:
        """Copy the wheel at ``path`` in (a no-op when a file of that digest is there); returns
        what it is, its digest computed from the bytes copied."""
        self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp_name = tempfile.mkstemp(dir=self._dir, prefix=".add-")
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            size = 0
            with path.open("rb") as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    size += len(chunk)
            wheel = wheel_of(path, digest.hexdigest(), size)
            if self.has(wheel.sha256):
                return self.get(wheel.sha256) or wheel
            os.chmod(tmp, 0o644)
            os.replace(tmp, self._dir / wheel.sha256)
            meta = self._dir / f".{wheel.sha256}.json.part"
            meta.write_text(json.dumps(wheel.to_json()))
            os.replace(meta, self._dir / f"{wheel.sha256}.json")
            return wheel
        finally:
            tmp.unlink(missing_ok=True)

    def find(self, name: str, version: str) -> list[Wheel]:
        """Every stored wheel of ``name`` ``version`` (for a tool the store already holds)."""
        if not self._dir.is_dir():
            return []
        found = []
        for meta in self._dir.glob("*.json"):
            wheel = Wheel.from_json(json.loads(meta.read_text()))
            if wheel.name == normalize(name) and wheel.version == version:
                found.append(wheel)
        return found

    def link_into(self, wheels: list[Wheel], folder: Path) -> None:
        """Put each wheel in ``folder`` under its real file name (a hard link, else a copy):
        what uv and pip install from."""
        folder.mkdir(parents=True, exist_ok=True)
        for wheel in wheels:
            dest = folder / wheel.filename
            if dest.exists():
                continue
            try:
                os.link(self.path(wheel), dest)
            except OSError:
                shutil.copyfile(self.path(wheel), dest)
