"""A ``requirements*.txt`` (pins, ``--hash``, ``-r``/``-c`` includes, ``--index-url``/
``--extra-index-url``/``--find-links`` lines) and a ``pyproject.toml`` (its ``[project]
dependencies``) -> :class:`Declared`. A requirements file is exact when every requirement is
``NAME==VERSION`` with a ``--hash`` (as pip's hash-checking mode wants them: what ``uv pip
compile --generate-hashes`` writes); anything else is resolved by uv. What a file says that makes
the head fetch from elsewhere is collected in ``Declared.elsewhere`` for the trust rule."""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ptcluster.errors import UsageError
from ptcluster.venvs.pins import Declared, Pin, read_bytes, read_toml, requirement
from ptcluster.venvs.platforms import check_python
from ptcluster.venvs.resolved import Platform, normalize


def read_pyproject(path: Path, platform: Platform | None) -> Declared:
    data = read_bytes(path)
    project = read_toml(path, data).get("project")
    if not isinstance(project, dict):
        raise UsageError(f"{path}: has no [project] table",
                         "list the packages under [project] dependencies, or give a lock or "
                         "requirements file")
    if "dependencies" in project.get("dynamic", []):
        raise UsageError(f"{path}: its dependencies are dynamic (computed by the build "
                         "backend)", "give a requirements file or a lock instead")
    deps = project.get("dependencies", [])
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise UsageError(f"{path}: [project] dependencies must be a list of strings",
                         'e.g. dependencies = ["numpy>=1.26"]')
    for dep in deps:
        requirement(dep, f"{path}: [project] dependencies")
    check_python(str(project.get("requires-python", "")), platform, str(path))
    return Declared(source=str(path), kind="pyproject", content=hashlib.sha256(data).hexdigest(),
                    pins=None, requirements=tuple(deps))


_COMMENT = re.compile(r"(^|\s)#.*$")
_FETCH_OPTIONS = {"-i": "index", "--index-url": "index", "--extra-index-url": "index",
                  "-f": "find-links", "--find-links": "find-links",
                  "--trusted-host": "trusted-host"}
_HARMLESS = {"--no-index", "--pre", "--prefer-binary", "--require-hashes", "--only-binary",
             "--no-binary", "--use-feature"}
_INCLUDES = {"-r", "--requirement", "-c", "--constraint"}


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of each line, continuations joined, comments dropped."""
    out: list[tuple[int, str]] = []
    held, start = "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not held:
            start = number
        if line.endswith("\\"):
            held += line[:-1] + " "
            continue
        joined = _COMMENT.sub("", held + line).strip()
        held = ""
        if joined:
            out.append((start, joined))
    return out


@dataclass
class _Reading:
    pins: list[Pin]
    exact: bool
    elsewhere: list[str]
    indexes: list[str]
    digest: Any
    seen: set[Path]


def read_requirements(path: Path) -> Declared:
    """A requirements file (and its ``-r``/``-c`` includes): exact when every requirement is
    ``NAME==VERSION`` with a ``--hash`` (as pip's hash-checking mode wants them)."""
    reading = _Reading(pins=[], exact=True, elsewhere=[], indexes=[], digest=hashlib.sha256(),
                       seen=set())
    _read_into(path, reading, constraint=False)
    exact = reading.exact and bool(reading.pins)
    return Declared(source=str(path), kind="requirements", content=reading.digest.hexdigest(),
                    pins=tuple(reading.pins) if exact else None,
                    elsewhere=tuple(dict.fromkeys(reading.elsewhere)),
                    indexes=tuple(dict.fromkeys(reading.indexes)))


def _read_into(path: Path, reading: _Reading, constraint: bool) -> None:
    real = path.resolve()
    if real in reading.seen:
        return
    reading.seen.add(real)
    data = read_bytes(path)
    reading.digest.update(str(path).encode() + b"\0" + data + b"\0")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text", "save it as UTF-8") from None
    for number, line in _logical_lines(text):
        where = f"{path}:{number}"
        if line.startswith("-") and not line.startswith("--hash"):
            try:
                words = shlex.split(line)
            except ValueError as exc:
                raise UsageError(f"{where}: cannot read {line!r} ({exc})",
                                 "fix the quoting") from None
            _option(words, path, where, reading)
            continue
        # a requirement is read as written (pip's way, not a shell's): a marker's quotes stay
        words = line.split()
        if constraint:  # a constraint limits a resolution; it is not a pin of the set
            reading.exact = False
            continue
        _pin_line(words, where, reading)


def _option(words: list[str], path: Path, where: str, reading: _Reading) -> None:
    flag, _, value = words[0].partition("=")
    if not value and len(words) > 1:
        value = words[1]
    if flag in _INCLUDES:
        if not value:
            raise UsageError(f"{where}: {flag} names no file", f"write {flag} FILE")
        if "://" in value:
            raise UsageError(f"{where}: {flag} {value} is a URL, which ptcluster does not fetch",
                             "keep the included file beside this one")
        if not (path.parent / value).is_file():
            raise UsageError(f"{where}: {flag} {value}: the included file is not there",
                             "check the path (relative to this file's folder)")
        _read_into(path.parent / value, reading, constraint=flag in ("-c", "--constraint"))
    elif flag in _FETCH_OPTIONS:
        reading.elsewhere.append(f"{flag} {value} ({where})")
        if _FETCH_OPTIONS[flag] == "index":
            reading.indexes.append(value)
    elif flag in ("-e", "--editable"):
        raise UsageError(f"{where}: an editable requirement ({value}) is the project's own "
                         "code, which comes from the workdir (run --sync), not the environment",
                         "remove the line")
    elif flag not in _HARMLESS:
        raise UsageError(f"{where}: option {flag} is not one ptcluster reads",
                         "remove it (pins, --hash, -r, -c, --index-url, --extra-index-url, "
                         "--find-links and --no-index are read)")


def _pin_line(words: list[str], where: str, reading: _Reading) -> None:
    hashes, rest = set(), []
    for i, word in enumerate(words):
        if word.startswith("--hash"):
            algo, _, hexd = word.partition("=")[2].partition(":")
            if algo == "sha256" and re.fullmatch(r"[0-9a-f]{64}", hexd):
                hashes.add(hexd)
            elif not hexd and i + 1 < len(words):
                raise UsageError(f"{where}: write --hash=sha256:HEX", "fix the line")
        else:
            rest.append(word)
    req = requirement(" ".join(rest), where)
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version \
            and hashes:
        reading.pins.append(Pin(name=normalize(req.name), version=specs[0].version,
                                hashes=frozenset(hashes),
                                marker=str(req.marker) if req.marker else ""))
    else:
        reading.exact = False
