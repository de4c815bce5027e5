"""The entry point: a declared file -> a :class:`ResolvedEnv` for one node platform.

Resolved once on the head and cached by the file's content, the platform and the
``--find-links`` folders (``<store>/resolved/<key>.json``); ``refresh`` resolves again. A lock
(or a hashed, fully pinned requirements file) is already exact; anything else is resolved with
uv (``uv pip compile --python-version --python-platform --generate-hashes``) for the node's
platform, run in an empty folder so that no project's own uv configuration is read (the user's
is). With ``--find-links`` the folders are the only source: nothing is downloaded.

What setup owns (torch, its ``nvidia-*`` libraries, triton, ptcluster) is never shipped: the
environment sees setup's beneath its own packages. What the file pins of them is kept in
``ResolvedEnv.held``, and ``check_torch`` refuses a torch pin the nodes do not have.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ptcluster.errors import UsageError
from ptcluster.venvs.choice import EnvChoice
from ptcluster.venvs.declared import read_declared
from ptcluster.venvs.fetch import obtain
from ptcluster.venvs.lockfiles import marker_holds
from ptcluster.venvs.pins import Declared, Pin
from ptcluster.venvs.platforms import marker_env, uv_platform
from ptcluster.venvs.problems import (
    INDEX_UNTRUSTED,
    NOT_A_FOLDER,
    PTCLUSTER_DIFFERS,
    TORCH_DIFFERS,
)
from ptcluster.venvs.reqfile import read_requirements
from ptcluster.venvs.resolved import SETUP_OWNS, Platform, ResolvedEnv, normalize, setup_owns
from ptcluster.venvs.store import WheelStore
from ptcluster.venvs.tools import uv_binary, uv_wheel

COMPILE_TIMEOUT = 900.0
"""Seconds uv may take to resolve a set."""
CACHE_FORMAT = 1


def check_trust(declared: Declared, trusted: bool) -> None:
    """A file that makes the head fetch from another index or folder is refused unless the user
    vouches for it (``cluster.trust``'s rule: a file picked up from a cloned repository must
    not choose where this machine's code comes from)."""
    if declared.elsewhere and not trusted:
        raise UsageError.of(INDEX_UNTRUSTED, source=declared.source,
                            elsewhere=declared.elsewhere[0])


def precheck(spec_file: Path, platform: Platform | None, find_links: Sequence[Path],
             trusted: bool) -> Declared:
    """What the head knows without fetching anything: the file is one of the four kinds and
    reads, it is trusted where it must be, and the ``--find-links`` folders are folders. An
    exit-2 error before any node is touched."""
    declared = read_declared(Path(spec_file), platform)
    check_trust(declared, trusted)
    for folder in find_links:
        if not Path(folder).is_dir():
            raise UsageError.of(NOT_A_FOLDER, folder=folder)
    return declared


def cache_key(declared: Declared, platform: Platform, find_links: Sequence[Path]) -> str:
    body = json.dumps([CACHE_FORMAT, declared.content, platform.to_json(),
                       [str(Path(d).resolve()) for d in find_links]])
    return hashlib.sha256(body.encode()).hexdigest()


def _cached(path: Path, store: WheelStore, source: str) -> ResolvedEnv | None:
    try:
        env = ResolvedEnv.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(store.has(w.sha256) for w in (*env.wheels, *env.tools)):
        return None
    return ResolvedEnv(source=source, kind=env.kind, platform=env.platform, wheels=env.wheels,
                       tools=env.tools, held=env.held)


def resolve(spec_file: Path, platform: Platform, *, find_links: Sequence[Path], refresh: bool,
            store: WheelStore, trusted: bool) -> ResolvedEnv:
    """``spec_file`` resolved for ``platform``, every wheel in ``store``. Bad input is an
    exit-2 error (``UsageError``) naming the file, the package and the fix."""
    declared = precheck(spec_file, platform, find_links, trusted)
    cache = store.root / "resolved" / f"{cache_key(declared, platform, find_links)}.json"
    if not refresh:
        hit = _cached(cache, store, str(spec_file))
        if hit is not None:
            return hit
    pins = declared.pins if declared.pins is not None else \
        compile_pins(declared, platform, find_links, refresh)
    env_markers = marker_env(platform)
    pins = tuple(p for p in pins if marker_holds(p.marker, env_markers, f"{spec_file}: {p.name}"))
    shipped = [p for p in pins if not setup_owns(p.name)]
    wheels = obtain(shipped, platform, source=str(spec_file), find_links=find_links,
                    store=store, trusted=trusted, indexes=declared.indexes)
    tool = uv_wheel(platform, find_links=find_links, store=store)
    env = ResolvedEnv(source=str(spec_file), kind=declared.kind, platform=platform,
                      wheels=tuple(wheels), tools=(tool,),
                      held=tuple((p.name, p.version) for p in pins if setup_owns(p.name)))
    cache.parent.mkdir(parents=True, exist_ok=True)
    part = cache.with_name(f".{cache.name}.{os.getpid()}")
    part.write_text(json.dumps(env.to_json(), indent=1))
    os.replace(part, cache)
    return env


def resolve_each(choice: EnvChoice, platforms: Iterable[Platform],
                 store: WheelStore) -> dict[Platform, ResolvedEnv]:
    """``choice`` resolved once for each distinct node platform (nodes of one platform share
    one environment, and one digest)."""
    return {platform: resolve(choice.requirements, platform, find_links=choice.find_links,
                              refresh=choice.refresh, store=store, trusted=choice.trusted)
            for platform in dict.fromkeys(platforms)}


def compile_pins(declared: Declared, platform: Platform, find_links: Sequence[Path],
                 refresh: bool) -> tuple[Pin, ...]:
    """uv's resolution of a requirements file or a pyproject's dependencies for ``platform``.

    With ``--find-links`` (no index) setup's own packages are left out of the resolution by
    uv's overrides (a marker that never holds): the folders need not hold torch's wheels,
    which the nodes have already."""
    with tempfile.TemporaryDirectory(prefix="ptcluster-resolve-") as tmp:
        source = Path(declared.source).resolve()
        if declared.kind == "pyproject":
            source = Path(tmp, "requirements.in")
            source.write_text("".join(f"{r}\n" for r in declared.requirements))
        out = Path(tmp, "requirements.txt")
        argv = [str(uv_binary()), "pip", "compile", str(source), "--python-version",
                platform.python, "--python-platform", uv_platform(platform),
                "--generate-hashes", "--no-header", "--no-annotate", "--quiet",
                "--output-file", str(out)]
        if find_links:
            overrides = Path(tmp, "overrides.txt")
            overrides.write_text("".join(f"{name} ; sys_platform == 'never'\n"
                                         for name in SETUP_OWNS))
            argv += ["--no-index", "--overrides", str(overrides)]
            argv += [a for d in find_links for a in ("--find-links", str(Path(d).resolve()))]
        elif refresh:  # (a folder's files are read anew each time: only an index's are cached)
            argv.append("--refresh")
        try:
            proc = subprocess.run(argv, cwd=tmp, capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise UsageError(f"{declared.source}: uv did not resolve it in "
                             f"{COMPILE_TIMEOUT:.0f} s", "check the head's access to the "
                             "package index, or give the wheels' folder with --find-links") \
                from None
        if proc.returncode != 0:
            said = " ".join(line.strip() for line in proc.stderr.strip().splitlines()[-6:])
            raise UsageError(f"{declared.source}: uv could not resolve it for the nodes "
                             f"({platform}): {said}",
                             "fix the requirement uv names (a package that does not exist, "
                             "or has no version for this Python)" +
                             ("; or add its wheel to the --find-links folder" if find_links
                              else ""))
        resolved = read_requirements(out)
        return (resolved.pins or ()) + (setup_pins(declared) if find_links else ())


_EXACT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*===?\s*([^\s;#,\\]+)\s*(?:[;#\\]|$)")


def setup_pins(declared: Declared) -> tuple[Pin, ...]:
    """The exact pins of setup's own packages (torch, ptcluster, ...) that the file itself
    states: with ``--find-links`` uv leaves them out of its resolution (the folders need not
    hold torch), yet ``check_torch`` must still see them."""
    lines = declared.requirements if declared.kind == "pyproject" else \
        tuple(Path(declared.source).read_text(errors="replace").splitlines())
    found = (_EXACT.match(line) for line in lines)
    return tuple(Pin(normalize(m[1]), m[2]) for m in found if m and setup_owns(m[1]))


def _same(pinned: str, have: str) -> bool:
    """A pin matches what a node has: exactly where it names a local part (``+cpu``), else
    its public version (``2.13.0`` matches ``2.13.0+cu128``)."""
    try:
        want, got = Version(pinned), Version(have)
    except InvalidVersion:
        return pinned == have
    return want == got if want.local else want.public == got.public


def check_torch(pins: Iterable[tuple[str, str]], node_torch: str,
                node_ptcluster: str | None = None) -> None:
    """Refuse a file that pins another torch than the nodes have (``node_torch``, as setup's
    facts say it: ``2.13.0+cpu``): the environment is layered on setup's torch, never ships its
    own. So for ptcluster, when ``node_ptcluster`` is given (a node's ``0.1.0+g1a2b3c4d``)."""
    for name, version in pins:
        if name == "torch" and not _same(version, node_torch):
            raise UsageError.of(TORCH_DIFFERS, version=version, node_torch=node_torch,
                                node_release=node_torch.split("+")[0])
        if name == "ptcluster" and node_ptcluster and not _same(version, node_ptcluster):
            raise UsageError.of(PTCLUSTER_DIFFERS, version=version,
                                node_ptcluster=node_ptcluster,
                                node_release=node_ptcluster.split("+")[0])
