"""A node's project environments, on disk: where they live, their manifests, their checks, and
which to keep (``ptcluster venvs``). Standard library only: a part of ``node.venv_agent``.

Under the user's ptcluster directory (``~/.ptcluster``, the agent's ``root``)::

  store/sha256/HEX            a wheel, by the sha256 of its bytes (verified on arrival)
  envs/DIGEST/                a complete environment (a venv; ptcluster-env.json inside)
  envs/.build-DIGEST-RAND/    a build in progress: renamed to envs/DIGEST when complete
  envs/.lock-DIGEST           the flock a build of DIGEST holds (another job's build waits)
  envs/.used-DIGEST           touched whenever a job is given the environment: its last use
  uses/JOB.json               a running job's use of one (``records``: its guard's live pid)
  tools/uv-VERSION/uv         the uv that came with an environment

``ptcluster-env.json``: the resolved set, the interpreter it was made from, when, and each
installed file's ``[size, mtime_ns, sha256]`` (a link's ``[-1, 0, TARGET]``). ``run`` compares
sizes and times (cheap), ``doctor`` the hashes and the installed packages (full).
"""

import hashlib
import os
import re
import time

from ptcluster.node import venv_problems as P
from ptcluster.node.blobs import free_bytes
from ptcluster.node.problems import Sent
from ptcluster.node.sharing.records import alive, read_record
from ptcluster.node.sharing.safefile import remove_tree
from ptcluster.node.warm import pools

MANIFEST = "ptcluster-env.json"
SKIP_DIRS = ("__pycache__",)
"""Written by the interpreter when a rank imports a module: never in a manifest, never extra."""
BUILD_PREFIX, LOCK_PREFIX, USED_PREFIX = ".build-", ".lock-", ".used-"
KEEP_DEFAULT = 3
GRACE = 120.0
"""Seconds after a job was given an environment during which prune keeps it: between ``have``
and its guard's use record (the guard's prechecks) no record names the job yet."""
MAX_BYTES_DEFAULT = 20 << 30
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def walk_files(top: str) -> dict[str, str]:
    """``{relative path: absolute path}`` of every file and link under ``top`` (no
    ``__pycache__``, not the manifest itself)."""
    out = {}
    for base, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for d in dirs:  # links to directories (lib64 -> lib) are entries of their own
            full = os.path.join(base, d)
            if os.path.islink(full):
                out[os.path.relpath(full, top)] = full
        for name in files:
            full = os.path.join(base, name)
            rel = os.path.relpath(full, top)
            if rel != MANIFEST:
                out[rel] = full
    return out


def file_entry(full: str, hashed: bool = True) -> list:
    st = os.lstat(full)
    if os.path.islink(full):
        return [-1, 0, os.readlink(full)]
    return [st.st_size, st.st_mtime_ns, file_sha256(full) if hashed else ""]


def manifest_files(top: str) -> dict[str, list]:
    return {rel: file_entry(full) for rel, full in sorted(walk_files(top).items())}


def cheap_check(env_dir: str, manifest: dict) -> str:
    """"" when every file of the manifest is there with its size and time; else the first one
    that is not (what ``run`` checks before it uses an environment)."""
    for rel, (size, mtime, target) in manifest.get("files", {}).items():
        full = os.path.join(env_dir, rel)
        try:
            st = os.lstat(full)
        except OSError:
            return f"{rel} is missing"
        if size == -1:
            if not os.path.islink(full) or os.readlink(full) != target:
                return f"{rel} changed (a link to {target} at the build)"
        elif st.st_size != size or st.st_mtime_ns != mtime:
            return f"{rel} changed since the build ({size} bytes then, {st.st_size} now)"
    return ""


def env_state(env_dir: str, python: str = "") -> tuple[str, str]:
    """("ok" | "missing" | "changed", why) of the environment at ``env_dir``: complete (its
    manifest, written last before the rename into place) and unchanged by the cheap check.
    The ``venvs`` agent's ``have`` and the guard's check before any rank starts say the same.
    ``python`` ("X.Y"): the version its base must have (the guard's: the head chose the digest
    from what it remembered of the node, whose ``python:`` may have changed since)."""
    if not os.path.isdir(env_dir):
        return "missing", ""
    manifest = read_manifest(env_dir)
    why = cheap_check(env_dir, manifest) if manifest is not None else f"no {MANIFEST}"
    made = ((manifest or {}).get("resolved") or {}).get("platform", {}).get("python")
    if not why and python and made != python:
        why = f"made for Python {made}, this node's python: is {python}"
    return ("changed", why) if why else ("ok", "")


def env_python(root: str, digest: str) -> str:
    """An environment's interpreter under ``root`` (``~`` kept: expanded on the node)."""
    return os.path.join(root, "envs", digest, "bin", "python")


def read_manifest(env_dir: str) -> dict | None:
    got = read_record(os.path.join(env_dir, MANIFEST), limit=64 << 20, owners=(os.getuid(),))
    return got[0] if got is not None and isinstance(got[0], dict) else None


def norm(name: str) -> str:
    """A project name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(site: str) -> dict[str, tuple[str, str]]:
    """``{normalized name: (version, dist-info folder)}`` of what is installed in ``site``."""
    out = {}
    for entry in sorted(os.listdir(site)) if os.path.isdir(site) else []:
        if not entry.endswith(".dist-info"):
            continue
        fields: dict[str, str] = {}
        try:
            with open(os.path.join(site, entry, "METADATA"), encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        break
                    key, _, value = line.partition(":")
                    fields.setdefault(key.strip().lower(), value.strip())
        except OSError:
            continue
        if "name" in fields:
            out[norm(fields["name"])] = (fields.get("version", "?"), entry)
    return out


def owners(site: str, dists: dict[str, tuple[str, str]]) -> dict[str, str]:
    """``{path relative to site-packages: "name version"}`` from every dist's RECORD."""
    out = {}
    for name, (version, folder) in dists.items():
        try:
            with open(os.path.join(site, folder, "RECORD"), encoding="utf-8") as f:
                for line in f:
                    path = line.rsplit(",", 2)[0]
                    out[os.path.normpath(path)] = f"{name} {version}"
        except OSError:
            continue
    return out


def site_packages(env_dir: str) -> str:
    lib = os.path.join(env_dir, "lib")
    for entry in sorted(os.listdir(lib)) if os.path.isdir(lib) else []:
        if entry.startswith("python"):
            return os.path.join(lib, entry, "site-packages")
    return os.path.join(lib, "python", "site-packages")


def package_findings(env_dir: str, site: str, wheels: list[dict]) -> list[Sent]:
    """Missing, extra and different packages against the resolved ``wheels``."""
    have = installed(site)
    want = {norm(w["name"]): w["version"] for w in wheels}
    out: list[Sent] = []
    for name, version in sorted(want.items()):
        if name not in have:
            out.append(P.PACKAGE_MISSING.sent(name=name, version=version, env=env_dir))
        elif have[name][0] != version:
            out.append(P.PACKAGE_DIFFERS.sent(name=name, have=have[name][0], version=version,
                                              env=env_dir))
    for name, (version, _) in sorted(have.items()):
        if name not in want:
            out.append(P.PACKAGE_EXTRA.sent(name=name, version=version, env=env_dir))
    return out


def full_check(env_dir: str, wheels: list[dict]) -> list[Sent]:
    """Every difference between the environment and its build: packages, then files (hashes),
    each a declared problem (``venv_problems``: ``Declared.sent``) whose fields name the
    package and both versions, or the file, its package and both hashes."""
    manifest = read_manifest(env_dir)
    if manifest is None:
        return [P.NO_MANIFEST.sent(env=env_dir)]
    site = site_packages(env_dir)
    out = package_findings(env_dir, site, wheels)
    dists = installed(site)
    owner = owners(site, dists)
    now = walk_files(env_dir)
    site_rel = os.path.relpath(site, env_dir)
    for rel, (size, _mtime, sha) in manifest.get("files", {}).items():
        who = owner.get(os.path.relpath(rel, site_rel), "the environment")
        if rel not in now:
            out.append(P.FILE_MISSING.sent(path=rel, owner=who, env=env_dir))
            continue
        got = file_entry(now[rel])
        if size == -1 and got[2] != sha:
            out.append(P.LINK_CHANGED.sent(path=rel, owner=who, target=got[2], was=sha,
                                           env=env_dir))
        elif size != -1 and got[2] != sha:
            out.append(P.FILE_CHANGED.sent(path=rel, owner=who, was=sha[:12], now=got[2][:12],
                                           env=env_dir))
    for rel in sorted(set(now) - set(manifest.get("files", {}))):
        who = owner.get(os.path.relpath(rel, site_rel), "no package")
        out.append(P.FILE_ADDED.sent(path=rel, owner=who, env=env_dir))
    return out


# -- listing and pruning ---------------------------------------------------------------------

def uses(root: str) -> dict[str, list[str]]:
    """``{digest: [job id or "warm pool PID", ...]}``: the running jobs' use records (their pid
    alive), and this user's warm pools whose interpreter is the environment's (a pool forks its
    next ranks there: an environment gone under it would fail their imports)."""
    folder = os.path.join(root, "uses")
    out: dict[str, list[str]] = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        got = read_record(os.path.join(folder, name), owners=(os.getuid(),))
        record = got[0] if got is not None else None
        if isinstance(record, dict) and alive(record.get("pid")):
            out.setdefault(str(record.get("digest")), []).append(str(record.get("job_id")))
    envs = os.path.join(os.path.abspath(root), "envs") + os.sep
    for pool in pools.listed():
        python = os.path.abspath(pool["python"])
        if python.startswith(envs):
            out.setdefault(python[len(envs):].split(os.sep, 1)[0], []).append(
                f"warm pool {pool['pid']}")
    return out


def tree_size(top: str) -> int:
    total = 0
    for base, _dirs, files in os.walk(top):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_blocks * 512
            except OSError:
                pass
    return total


def last_used(root: str, digest: str, fallback: float) -> float:
    try:
        return os.stat(os.path.join(root, "envs", USED_PREFIX + digest)).st_mtime
    except OSError:
        return fallback


def mark_used(root: str, digest: str) -> None:
    path = os.path.join(root, "envs", USED_PREFIX + digest)
    with open(path, "a"):
        pass
    os.utime(path)


def listing(root: str) -> list[dict]:
    """Every environment of this user here, the most recently used first."""
    envs = os.path.join(root, "envs")
    in_use = uses(root)
    out = []
    for digest in os.listdir(envs) if os.path.isdir(envs) else []:
        full = os.path.join(envs, digest)
        if not _DIGEST.match(digest) or not os.path.isdir(full):
            continue
        manifest = read_manifest(full) or {}
        created = float(manifest.get("created") or os.stat(full).st_mtime)
        record = manifest.get("resolved") or {}
        out.append({"digest": digest, "path": full, "size": tree_size(full),
                    "created": created, "last_used": last_used(root, digest, created),
                    "in_use": in_use.get(digest, []), "source": record.get("source", ""),
                    "packages": len(record.get("wheels", []))})
    return sorted(out, key=lambda e: -e["last_used"])


def choose(envs: list[dict], keep: int, max_bytes: int, recent: float = 0.0
           ) -> tuple[list[dict], list[dict]]:
    """(kept, removed), each entry with its ``why``: one in use is always kept, and one given
    to a job since ``recent`` (a time: that job's guard may not have marked its use yet); then
    the ``keep`` most recently used; then the oldest unused of those go until the rest fits in
    ``max_bytes`` (the newest stays whatever its size). ``envs``: most recent first."""
    kept, removed = [], []
    for i, env in enumerate(envs):
        if env["in_use"]:
            kept.append({**env, "why": "in use by " + ", ".join(env["in_use"])})
        elif env.get("last_used", 0.0) > recent > 0:
            kept.append({**env, "in_use": ["a job starting"],
                         "why": "given to a job moments ago (it may be starting)"})
        elif i < keep:
            kept.append({**env, "why": f"among the {keep} most recently used"})
        else:
            removed.append({**env, "why": f"not among the {keep} most recently used"})
    total = sum(e["size"] for e in kept)
    for env in reversed(kept[1:]):
        if total <= max_bytes:
            break
        if env["in_use"]:
            continue
        kept.remove(env)
        total -= env["size"]
        removed.append({**env, "why": f"over the size cap ({max_bytes} bytes)"})
    return kept, removed


def prune(root: str, keep: int = KEEP_DEFAULT, max_bytes: int = MAX_BYTES_DEFAULT,
          grace: float = GRACE) -> dict:
    """Remove what :func:`choose` says (one given to a job less than ``grace`` s ago is kept),
    the wheels no kept environment needs, and builds whose builder is gone; ``{kept, removed,
    wheels_removed, builds_removed}``."""
    kept, removed = choose(listing(root), keep, max_bytes,
                           time.time() - grace if grace > 0 else 0.0)
    gone = []
    for env in removed:
        if uses(root).get(env["digest"]):  # (a job began using it meanwhile)
            kept.append({**env, "why": "in use (a job began using it)"})
            continue
        aside = os.path.join(root, "envs", f"{BUILD_PREFIX}gone-{env['digest']}-{os.getpid()}")
        os.rename(env["path"], aside)  # (atomic: never a half-removed environment in place)
        remove_tree(aside)
        for extra in (USED_PREFIX, LOCK_PREFIX):
            try:
                os.unlink(os.path.join(root, "envs", extra + env["digest"]))
            except OSError:
                pass
        gone.append(env)
    needed: set[str] = set()
    for env in kept:
        record = (read_manifest(env["path"]) or {}).get("resolved") or {}
        needed.update(w["sha256"] for w in [*record.get("wheels", []), *record.get("tools", [])])
    store = os.path.join(root, "store", "sha256")
    wheels = 0
    for name in os.listdir(store) if os.path.isdir(store) else []:
        if _DIGEST.match(name) and name not in needed:
            os.unlink(os.path.join(store, name))
            wheels += 1
    return {"kept": kept, "removed": gone, "wheels_removed": wheels,
            "builds_removed": stale_builds(root)}


def stale_builds(root: str, older: float = 3600.0) -> int:
    """Remove ``.build-*`` folders no build holds (their lock free) and older than ``older``
    s: what a killed agent could not remove."""
    envs = os.path.join(root, "envs")
    count = 0
    for name in os.listdir(envs) if os.path.isdir(envs) else []:
        full = os.path.join(envs, name)
        if name.startswith(BUILD_PREFIX) and time.time() - os.lstat(full).st_mtime > older:
            remove_tree(full)
            count += 1
    return count


def dist_version(name: str) -> str:
    """An installed distribution's version, read from its metadata (nothing imported)."""
    from importlib import metadata  # (~8 ms, and email's parser: not in every guard's start)

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def disk_problem(path: str, exc: BaseException) -> Sent:
    """A build's full disk, as the ``build`` answer says it (``venvs.disk-full``)."""
    return P.DISK_FULL.sent(path=path, free=free_bytes(os.path.dirname(path)), error=exc)
