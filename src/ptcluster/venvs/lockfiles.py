"""``uv.lock`` and ``pylock.toml`` (PEP 751) -> the exact pins a node of a platform gets.

A ``uv.lock`` is universal (every platform's packages): the node's set is what the project's
``dependencies`` reach, following each edge whose marker holds on the node (and the extras an
edge asks for). The project itself (an ``editable`` or ``virtual`` source) is its code, which
comes from the workdir; its dev dependency groups are left out (as ``uv sync --no-dev``). A
``pylock.toml`` lists packages, each with a marker: those whose marker holds. A pin's hashes are
its wheels' (an sdist's digest only checks a build)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from packaging.markers import InvalidMarker, Marker, UndefinedComparison

from ptcluster.errors import UsageError
from ptcluster.venvs.pins import Declared, LockedFile, Pin, read_bytes, read_toml
from ptcluster.venvs.platforms import check_python, head_platform, marker_env
from ptcluster.venvs.resolved import Platform, normalize

PYPI = "https://pypi.org/simple"
_PROJECT_SOURCES = ("editable", "virtual")


def marker_holds(marker: str, env: dict[str, str], where: str) -> bool:
    if not marker:
        return True
    try:
        return bool(Marker(marker).evaluate(env))
    except (InvalidMarker, UndefinedComparison) as exc:
        raise UsageError(f"{where}: cannot read its marker {marker!r} ({exc})",
                         "regenerate the lock") from None


def _local(where: str) -> str:
    """A wheel's local path (``path``, or a ``file://`` URL), or "" for one on an index."""
    if where.startswith("file://"):
        return where[len("file://"):]
    return "" if "://" in where else where


def _remote_index(index: str) -> str:
    """The index a lock names, when it is another one than PyPI on the network ("" for PyPI
    and for a local folder, which fetches nothing from elsewhere)."""
    if index.rstrip("/") in ("", PYPI) or "://" not in index or index.startswith("file://"):
        return ""
    return index


def _sha256(value: Any, where: str) -> str:
    """``sha256:HEX`` (uv.lock) -> HEX."""
    algo, _, hexd = str(value).partition(":")
    if algo != "sha256" or len(hexd) != 64:
        raise UsageError(f"{where}: hash {value!r} is not sha256:HEX",
                         "regenerate the lock (uv lock)")
    return hexd


def _entries(doc: dict[str, Any], key: str, path: Path) -> list[dict[str, Any]]:
    entries = doc.get(key, [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise UsageError(f"{path}: [[{key}]] must be tables", "regenerate the lock")
    for i, e in enumerate(entries):
        if not isinstance(e.get("name"), str):
            raise UsageError(f"{path}: [[{key}]] #{i + 1} has no name", "regenerate the lock")
    return entries


def _uv_pin(entry: dict[str, Any], path: Path) -> Pin:
    name, version = normalize(entry["name"]), str(entry.get("version", ""))
    where = f"{path}: package {name}"
    source = entry.get("source", {})
    files, hashes = [], set()
    for w in entry.get("wheels", []):
        local = _local(str(w.get("path") or w.get("url") or ""))
        filename = str(w.get("url") or w.get("path") or "").rsplit("/", 1)[-1]
        sha = _sha256(w["hash"], where) if "hash" in w else ""  # (none for a local folder's)
        files.append(LockedFile(filename=filename, sha256=sha, path=local))
        if sha:
            hashes.add(sha)
    if "path" in source and str(source["path"]).endswith(".whl"):
        filename = str(source["path"]).rsplit("/", 1)[-1]
        files = [LockedFile(filename=filename, sha256="", path=str(source["path"]))]
    elif "registry" not in source:
        what = ", ".join(f"{k} {v}" for k, v in source.items())
        raise UsageError(f"{where} comes from {what}: ptcluster ships wheels from an index or "
                         "a wheel file only", "publish it as a wheel (or build one and give "
                         "its folder with --find-links), and lock again")
    return Pin(name=name, version=version, hashes=frozenset(hashes), files=tuple(files),
               index=_remote_index(str(source.get("registry", ""))))


def _uv_lock_pins(doc: dict[str, Any], path: Path, env: dict[str, str]) -> list[Pin]:
    packages = _entries(doc, "package", path)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for e in packages:
        by_name.setdefault(normalize(e["name"]), []).append(e)
    roots = [e for e in packages if any(k in e.get("source", {}) for k in _PROJECT_SOURCES)]
    if not roots:
        raise UsageError(f"{path}: names no project (a package with an editable or virtual "
                         "source)", "run `uv lock` in the project's folder")
    seen: set[tuple[str, str, str]] = set()
    chosen: dict[tuple[str, str], dict[str, Any]] = {}
    todo: list[tuple[dict[str, Any], Iterable[str]]] = [(r, ()) for r in roots]
    while todo:
        entry, extras = todo.pop()
        edges = list(entry.get("dependencies", []))
        for extra in extras:
            edges += entry.get("optional-dependencies", {}).get(extra, [])
        for edge in edges:
            where = f"{path}: {entry['name']} -> {edge.get('name')}"
            if not marker_holds(str(edge.get("marker", "")), env, where):
                continue
            target = _edge_target(edge, by_name, env, where)
            for extra in [None, *edge.get("extra", [])]:
                key = (normalize(target["name"]), str(target.get("version", "")), extra or "")
                if key in seen:
                    continue
                seen.add(key)
                chosen[key[:2]] = target
                todo.append((target, [extra] if extra else []))
    pins = [_uv_pin(e, path) for e in chosen.values()
            if not any(k in e.get("source", {}) for k in _PROJECT_SOURCES)]
    return sorted(pins, key=lambda p: p.name)


def _edge_target(edge: dict[str, Any], by_name: dict[str, list[dict[str, Any]]],
                 env: dict[str, str], where: str) -> dict[str, Any]:
    found = by_name.get(normalize(str(edge.get("name", ""))), [])
    if "version" in edge:
        found = [e for e in found if str(e.get("version")) == str(edge["version"])]
    if len(found) > 1:  # a forked resolution: the entry whose resolution markers hold
        found = [e for e in found if any(marker_holds(m, env, where)
                                         for m in e.get("resolution-markers", [""]))] or found
    if not found:
        raise UsageError(f"{where}: the lock has no such package", "run `uv lock` again")
    return found[0]


def _pylock_pin(entry: dict[str, Any], path: Path) -> Pin:
    name = normalize(entry["name"])
    where = f"{path}: package {name}"
    files, hashes = [], set()
    for w in entry.get("wheels", []):
        sha = str((w.get("hashes") or {}).get("sha256", ""))
        if len(sha) != 64:
            raise UsageError(f"{where}: a wheel without a sha256 hash", "regenerate the lock")
        filename = str(w.get("name") or str(w.get("url") or w.get("path", "")).rsplit("/", 1)[-1])
        local = _local(str(w.get("path") or w.get("url") or ""))
        files.append(LockedFile(filename=filename, sha256=sha, path=local))
        hashes.add(sha)
    if not files and not entry.get("sdist"):
        kind = next((k for k in ("vcs", "directory", "archive") if k in entry), "no file")
        raise UsageError(f"{where} comes from {kind}: ptcluster ships wheels from an index or "
                         "a wheel file only", "publish it as a wheel, and lock again")
    version = str(entry.get("version", ""))
    if not version:
        raise UsageError(f"{where} has no version", "regenerate the lock")
    return Pin(name=name, version=version, hashes=frozenset(hashes), files=tuple(files),
               index=_remote_index(str(entry.get("index", ""))))


def read_lock(path: Path, kind: str, platform: Platform | None) -> Declared:
    """A ``uv.lock`` or ``pylock.toml``: the pins that apply to ``platform``."""
    data = read_bytes(path)
    doc = read_toml(path, data)
    check_python(str(doc.get("requires-python", "")), platform, str(path))
    env = marker_env(platform or head_platform())
    if kind == "uv.lock":
        pins = _uv_lock_pins(doc, path, env)
    else:
        if not str(doc.get("lock-version", "")).startswith("1."):
            raise UsageError(f"{path}: lock-version {doc.get('lock-version')!r} is not 1.x "
                             "(PEP 751)", "regenerate it (uv export --format pylock.toml)")
        pins = [_pylock_pin(e, path) for e in _entries(doc, "packages", path)
                if marker_holds(str(e.get("marker", "")), env, f"{path}: package {e['name']}")]
    elsewhere = sorted({f"the index {p.index} (package {p.name})" for p in pins if p.index})
    return Declared(source=str(path), kind=kind, content=hashlib.sha256(data).hexdigest(),
                    pins=tuple(sorted(pins, key=lambda p: p.name)), elsewhere=tuple(elsewhere))
