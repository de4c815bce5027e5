"""What a declared file says, whatever its kind: exact pins (with the digests their files
may have) or requirements to resolve; and the helpers the readers share."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement

from ptcluster.errors import UsageError
from ptcluster.venvs.problems import REQUIREMENTS_MISSING

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the same parser, as the tomli package
    import tomli as tomllib


@dataclass(frozen=True)
class LockedFile:
    """A wheel a lock names for a pin."""

    filename: str
    sha256: str
    path: str = ""
    """A local file (relative to the lock's folder), or "" for one from an index."""


@dataclass(frozen=True)
class Pin:
    """One exact requirement: ``name==version``, with the file digests it may come as."""

    name: str
    version: str
    hashes: frozenset[str] = frozenset()
    """sha256 (hex) of every file it may be (empty: any; only from a resolution we ran)."""
    files: tuple[LockedFile, ...] = ()
    """The wheels a lock lists for it (empty: the file or index decides)."""
    index: str = ""
    """The index a lock names for it ("": the head's default)."""
    marker: str = ""
    """A PEP 508 marker still to evaluate for the node ("" : always)."""

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Declared:
    source: str
    kind: str
    content: str
    """sha256 of every byte read (the file and its includes): the resolution cache's key."""
    pins: tuple[Pin, ...] | None
    """The exact set, or None when it must be resolved."""
    requirements: tuple[str, ...] = ()
    """For a pyproject.toml: its dependencies, one requirement each (uv reads a requirements
    file itself)."""
    elsewhere: tuple[str, ...] = ()
    indexes: tuple[str, ...] = ()
    """The indexes a requirements file names (``--index-url``, ``--extra-index-url``): pip's
    download looks there too (only a trusted file gets this far)."""
    """What the file makes the head fetch from, besides the default index (said in words)."""


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise UsageError.of(REQUIREMENTS_MISSING, path=path) from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it: {exc.strerror}", "check the file") from None


def read_toml(path: Path, data: bytes) -> dict[str, Any]:
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}", "fix the file") from None


def requirement(text: str, where: str) -> Requirement:
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        raise UsageError(f"{where}: {text!r} is not a requirement ({exc})",
                         "write NAME, NAME==VERSION or NAME>=VERSION") from None
    if req.url:
        raise UsageError(f"{where}: {req.name} comes from a URL ({req.url}), which ptcluster "
                         "does not fetch", "publish it as a wheel, and give the folder that "
                         "holds it with --find-links")
    return req
