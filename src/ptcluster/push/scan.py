"""The head's side of a push: what SRC holds (every regular file, its size, mtime, sha256)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ptcluster.errors import UsageError
from ptcluster.node.problems import Declared

CHUNK = 1 << 20


@dataclass(frozen=True)
class DataFile:
    path: str
    """Relative to SRC, ``/``-separated."""
    size: int
    mtime_ns: int
    sha256: str


@dataclass(frozen=True)
class Listing:
    src: Path
    files: tuple[DataFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


SRC_MISSING = Declared("push.src-missing", "the folder to push does not exist",
                       "push: {src} does not exist", "name the folder to push (SRC)")
SRC_NOT_A_FOLDER = Declared("push.src-not-a-folder", "the folder to push is not a folder",
                            "push: {src} is not a folder", "name the folder to push (SRC)")
SRC_UNREADABLE = Declared("push.src-unreadable", "a file to push cannot be read",
                          "push: cannot read {path}: {error}",
                          "make it readable by this user, or leave it out of SRC")
TABLE = (SRC_MISSING, SRC_NOT_A_FOLDER, SRC_UNREADABLE)
"""What ``push`` (and ``run --data``) refuses in SRC (``push.*`` codes)."""


def scan(src: Path) -> Listing:
    """Every regular file below ``src`` (a symlink to a file: its target's content; a
    symlinked folder is not entered), hashed. Raises ``UsageError`` (exit 2) naming SRC when it is
    missing or not a folder, or the first file or folder it cannot read."""
    src = src.expanduser().absolute()
    if not src.is_dir():
        raise UsageError.of(SRC_NOT_A_FOLDER if src.exists() else SRC_MISSING, src=src)
    files = []

    def refuse(exc: OSError) -> None:
        raise exc

    try:
        for top, dirs, names in os.walk(src, onerror=refuse):
            dirs.sort()
            for name in sorted(names):
                path = Path(top) / name
                if not path.is_file():
                    continue
                st = path.stat()
                files.append(DataFile(path.relative_to(src).as_posix(), st.st_size,
                                      st.st_mtime_ns, _sha256(path)))
    except OSError as exc:
        raise UsageError.of(SRC_UNREADABLE, path=exc.filename or src,
                            error=exc.strerror or exc) from exc
    return Listing(src, tuple(files))
