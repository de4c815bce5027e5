"""Where a checkpoint lives on a node's disk, its marker, and which step a load may take.

Standard library only: the ranks' save and load use it, and so does the head's ``collect``.

On every node, under its checkpoint root (the workdir, or ``PTCLUSTER_CKPT_ROOT``) and ``dir``::

    step-<N>/                 the files this node's ranks wrote (DCP: __<rank>_<i>.distcp,
                              and .metadata on the coordinator's node)
    step-<N>/replica-of-<K>/  node K's files, replicated here (K = this node - 1, in a ring)
    step-<N>/COMPLETE         the marker, written last (atomic rename): every node's files with
                              their size and sha256, and where each node's replica is

A step counts only where some node holds its marker: the marker is written once every node has
written its part and its replica (an all-gather said so), so a kill at any moment leaves a step
either unmarked everywhere (never loaded) or with every file on disk somewhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ptcluster.node.ckpt_list import (
    MARKER,
    REPLICA_PREFIX,
    TMP_SUFFIX,
    StepHeld,
    list_steps,
    part_files,
)
from ptcluster.node.rank_wire import CKPT_ROOT_VAR

__all__ = ["MARKER", "TMP_SUFFIX"]
FORMAT = 1
HASH_CHUNK = 1 << 20


def root_dir(dir: str | os.PathLike[str]) -> Path:
    """``dir`` on this node: as it is when absolute, else under ``CKPT_ROOT_VAR`` (a test's or
    a user's own per-node disk) or the current directory (a rank runs in the workdir)."""
    path = Path(dir)
    if path.is_absolute():
        return path
    return Path(os.environ.get(CKPT_ROOT_VAR) or os.getcwd()) / path


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{int(step)}"


def replica_dir(root: Path, step: int, node: int) -> Path:
    return step_dir(root, step) / f"{REPLICA_PREFIX}{int(node)}"


def check_owner(root: Path) -> None:
    """Refuse a checkpoint directory (or the first existing parent) another user owns: we would
    write our state where they can read or replace it. Raises ``PermissionError``."""
    for path in (root, *root.parents):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if path == root and st.st_uid != os.getuid():
            raise PermissionError(f"{root} belongs to uid {st.st_uid}, not this user "
                                  f"({os.getuid()}): choose a directory of yours")
        return


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def own_files(folder: Path) -> list[str]:
    """The part files a node's ranks wrote in a step's folder (not the marker, replicas or
    temporary files), sorted."""
    return part_files(str(folder))


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path``: a temporary file, fsync, rename, fsync of the folder."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Manifest:
    """A marker's content: the step, the save's id, every node's files ``{name: [size, sha]}``."""

    step: int
    save_id: str
    nodes: dict[int, dict[str, list]] = field(default_factory=dict)
    """Node index (of the job that saved) -> its files; node K's replica is on node K+1 mod n."""

    def files(self) -> dict[str, list]:
        return {name: info for part in self.nodes.values() for name, info in part.items()}

    def to_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT, "step": self.step, "save_id": self.save_id,
                           "nodes": {str(k): v for k, v in self.nodes.items()}},
                          sort_keys=True).encode()

    @staticmethod
    def parse(data: bytes) -> Manifest | None:
        try:
            raw = json.loads(data)
            return Manifest(int(raw["step"]), str(raw["save_id"]),
                            {int(k): {str(n): [int(i[0]), str(i[1])] for n, i in v.items()}
                             for k, v in raw["nodes"].items()})
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None


@dataclass(frozen=True)
class Holding:
    """One step as one node's disk holds it: its marker (None: none) and the files there,
    ``{name: [relative path under the root, size]}`` (own parts and replicas alike)."""

    step: int
    manifest: Manifest | None
    files: dict[str, list]


def read_marker(folder: Path) -> Manifest | None:
    try:
        data = (folder / MARKER).read_bytes()
    except OSError:
        return None
    return Manifest.parse(data)


def holdings(steps: list[StepHeld]) -> list[Holding]:
    """``node.ckpt_list.list_steps``'s answer (a rank's own, or a node's ``ckpt`` frame's)."""
    out = []
    for d in steps:
        marker = d.get("marker")
        manifest = Manifest.parse(marker.encode()) if isinstance(marker, str) else None
        out.append(Holding(int(d["step"]), manifest,
                           {str(k): [str(v[0]), int(v[1])] for k, v in d["files"].items()}))
    return out


def list_node(root: Path) -> list[Holding]:
    """Every step folder under ``root`` on this node, newest first."""
    return holdings(list_steps(str(root)))


@dataclass(frozen=True)
class Choice:
    """The step a load takes: its manifest, and for each file the nodes (indices into the
    listing) that hold it with the right size, those with the marker first."""

    manifest: Manifest
    holders: dict[str, list[int]]


def choose(listings: list[list[Holding]], step: int | None = None) -> tuple[Choice | None, str]:
    """The newest step (or ``step``) some node marked complete whose every file some node
    holds; else None and why, in words."""
    markers: dict[int, list[Manifest]] = {}
    for listing in listings:
        for h in listing:
            if h.manifest is not None and h.manifest.step == h.step:
                markers.setdefault(h.step, []).append(h.manifest)
    if not markers:
        return None, "no node holds a complete checkpoint"
    if step is not None and step not in markers:
        return None, f"no node holds a complete checkpoint of step {step} (have: " \
                     f"{', '.join(str(s) for s in sorted(markers))})"
    why = []
    for s in sorted(markers, reverse=True) if step is None else [step]:
        for manifest in {m.save_id: m for m in markers[s]}.values():
            holders, missing = _holders(listings, manifest)
            if not missing:
                return Choice(manifest, holders), ""
            why.append(f"step {s}: {len(missing)} file(s) on no node now ({missing[0]} ...)")
    return None, "; ".join(why)


def _holders(listings: list[list[Holding]], manifest: Manifest) -> tuple[dict[str, list[int]],
                                                                          list[str]]:
    """For each file, the nodes that hold it with its size: those with the step's marker
    first, and among them those that hold it as their own part (not a replica), so that a
    load or collect takes each node's part from that node while it is there."""
    ranked: dict[str, list[tuple[bool, bool, int]]] = {}
    for node, listing in enumerate(listings):
        for h in listing:
            if h.step != manifest.step:
                continue
            marked = h.manifest is not None and h.manifest.save_id == manifest.save_id
            for name, (size, _sha) in manifest.files().items():
                if name in h.files and h.files[name][1] == size:
                    replica = REPLICA_PREFIX in h.files[name][0]
                    ranked.setdefault(name, []).append((not marked, replica, node))
    holders = {name: [node for *_, node in sorted(where)] for name, where in ranked.items()}
    missing = sorted(set(manifest.files()) - set(holders))
    return holders, missing


def prune(root: Path, keep: int) -> list[int]:
    """Remove every step folder older than the ``keep`` newest complete ones (complete or not):
    the steps removed."""
    complete = [h.step for h in list_node(root) if h.manifest is not None]
    if keep <= 0 or len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1]
    gone = []
    for h in list_node(root):
        if h.step < oldest_kept:
            shutil.rmtree(step_dir(root, h.step), ignore_errors=True)
            gone.append(h.step)
    return gone
