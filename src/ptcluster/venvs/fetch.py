"""Bring a pinned set's wheels for a node platform into the head's :class:`WheelStore`.

Each pin comes, in this order, from the store (a file with one of its digests), from a
``--find-links`` folder (or the lock's own wheel file), or from pip's download of the node
platform's wheel. uv has no command that downloads wheels without installing them, so pip does
that here (``pip download --no-deps --only-binary=:all: --platform ...``; pip's own index
configuration, ``PIP_INDEX_URL`` and pip.conf, applies). Every file's sha256 is checked against
the pin's digests; a mismatch is an error naming the package, what the file says and what the
file has. With ``--find-links`` nothing is downloaded: the folders are the whole source.

A package with no wheel for the platform is built from its sdist with ``pip wheel`` only when
the declared file is trusted (building runs its code), a compiler is here, and this machine
is of the node's platform; else it is named with the platform.
"""

from __future__ import annotations

import os
import platform as host
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from ptcluster.errors import PtclusterError, UsageError
from ptcluster.venvs.pins import Pin
from ptcluster.venvs.platforms import best_file, pip_platform_args
from ptcluster.venvs.problems import (
    BUILD_ELSEWHERE,
    BUILD_FAILED,
    BUILD_NO_COMPILER,
    BUILD_UNTRUSTED,
)
from ptcluster.venvs.resolved import Platform, Wheel, normalize
from ptcluster.venvs.store import WheelStore, file_sha256

PIP_TIMEOUT = 1800.0
"""Seconds pip may take to download (or build) a set's wheels."""


def _mismatch(pin: Pin, filename: str, actual: str, source: str) -> UsageError:
    expected = ", ".join(sorted(pin.hashes))
    return UsageError(f"{pin.name} {pin.version}: {filename} has sha256 {actual}, but {source} "
                      f"allows only {expected}",
                      "if the package changed on purpose, lock again (uv lock, or uv pip compile "
                      "--generate-hashes); else find out who changed the file")


def _from_store(pin: Pin, platform: Platform, store: WheelStore) -> Wheel | None:
    stored = [w for w in (store.get(h) for h in sorted(pin.hashes)) if w is not None]
    best = best_file([w.filename for w in stored], platform)
    return next((w for w in stored if w.filename == best), None)


def _candidates(pin: Pin, folders: Sequence[Path]) -> list[Path]:
    found = []
    for folder in folders:
        for path in sorted(folder.glob("*.whl")):
            try:
                name, version, _b, _t = parse_wheel_filename(path.name)
            except InvalidWheelFilename:
                continue
            if normalize(str(name)) == pin.name and str(version) == pin.version:
                found.append(path)
    return found


def _from_files(pin: Pin, platform: Platform, paths: list[Path], store: WheelStore,
                source: str) -> Wheel | None:
    """The best file of ``paths`` for ``platform``, checked against the pin and stored."""
    best = best_file([p.name for p in paths], platform)
    if best is None:
        return None
    path = next(p for p in paths if p.name == best)
    actual = file_sha256(path)
    if pin.hashes and actual not in pin.hashes:
        raise _mismatch(pin, str(path), actual, source)
    return store.add(path)


def from_folders(pin: Pin, platform: Platform, folders: Sequence[Path], store: WheelStore,
                 source: str) -> Wheel | None:
    """``pin``'s best wheel for ``platform`` in ``folders``, checked and stored (None: none)."""
    return _from_files(pin, platform, _candidates(pin, folders), store, source)


def _lock_files(pin: Pin, lock_dir: Path) -> list[Path]:
    return [lock_dir / f.path for f in pin.files if f.path and (lock_dir / f.path).is_file()]


def obtain(pins: Sequence[Pin], platform: Platform, *, source: str, find_links: Sequence[Path],
           store: WheelStore, trusted: bool, indexes: Sequence[str] = ()) -> list[Wheel]:
    """Every pin's wheel for ``platform``, in the store; ``source`` names the declared file in
    errors, ``indexes`` are what it names besides pip's own (trusted only)."""
    lock_dir = Path(source).parent
    got: dict[str, Wheel] = {}
    missing: list[Pin] = []
    for pin in pins:
        wheel = _from_store(pin, platform, store) \
            or _from_files(pin, platform, _lock_files(pin, lock_dir), store, source) \
            or from_folders(pin, platform, find_links, store, source)
        if wheel is None:
            missing.append(pin)
        else:
            got[pin.name] = wheel
    if missing and not find_links:
        got.update(_download(missing, platform, store, source, trusted, indexes))
        missing = [p for p in missing if p.name not in got]
    for pin in missing:
        got[pin.name] = _build(pin, platform, store, find_links, trusted, source)
    return sorted(got.values(), key=lambda w: w.name)


def _pip(argv: list[str], what: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise PtclusterError(f"pip did not finish {what} in {PIP_TIMEOUT:.0f} s",
                             "check the head's access to the package index, or give the "
                             "wheels' folder with --find-links") from None


def _index_args(pins: Sequence[Pin], trusted: bool, indexes: Sequence[str]) -> list[str]:
    if not trusted:  # (a file that names any: refused before anything is fetched, check_trust)
        return []
    named = dict.fromkeys([*indexes, *sorted({p.index for p in pins if p.index})])
    return [a for index in named for a in ("--extra-index-url", index)]


def _download(pins: Sequence[Pin], platform: Platform, store: WheelStore, source: str,
              trusted: bool, indexes: Sequence[str]) -> dict[str, Wheel]:
    """pip's download of ``pins`` for ``platform`` (one pip for all; where it fails, each
    alone, to learn which has no wheel without reading pip's words)."""
    base = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
            "--only-binary=:all:", *pip_platform_args(platform),
            *_index_args(pins, trusted, indexes)]
    got: dict[str, Wheel] = {}
    with tempfile.TemporaryDirectory(prefix="ptcluster-wheels-") as tmp:
        proc = _pip([*base, "--dest", tmp, *map(str, pins)], "the download")
        batches = [pins] if proc.returncode == 0 else [[p] for p in pins]
        for batch in batches:
            if len(batches) > 1:
                _pip([*base, "--dest", tmp, str(batch[0])], f"the download of {batch[0]}")
            for pin in batch:
                wheel = _from_files(pin, platform, _candidates(pin, [Path(tmp)]), store, source)
                if wheel is not None:
                    got[pin.name] = wheel
    return got


def _build(pin: Pin, platform: Platform, store: WheelStore, find_links: Sequence[Path],
           trusted: bool, source: str) -> Wheel:
    """``pin`` built from its sdist on this machine, where that is allowed and can work."""
    where = {"source": source, "name": pin.name, "version": pin.version, "platform": platform,
             "links": f" in {', '.join(map(str, find_links))}" if find_links else ""}
    if not trusted:
        raise UsageError.of(BUILD_UNTRUSTED, **where)
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if (here, host.machine()) != (platform.python, platform.machine):
        raise UsageError.of(BUILD_ELSEWHERE, **where, here=here, machine=host.machine())
    if not (shutil.which("cc") or shutil.which("gcc")):
        raise UsageError.of(BUILD_NO_COMPILER, **where)
    links = [a for d in find_links for a in ("--no-index", "--find-links", str(d))]
    with tempfile.TemporaryDirectory(prefix="ptcluster-build-") as tmp:
        proc = _pip([sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check",
                     "--no-deps", "--no-binary", pin.name, *links, "--wheel-dir", tmp, str(pin)],
                    f"building {pin}")
        built = _candidates(pin, [Path(tmp)])
        if proc.returncode != 0 or not built:
            tail = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
            raise PtclusterError.of(BUILD_FAILED, **where, tail=tail)
        os.chmod(built[0], 0o644)
        return store.add(built[0])
