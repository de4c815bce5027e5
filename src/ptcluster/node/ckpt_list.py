"""What a node's disk holds of a ``ptcluster.checkpoint`` directory: every step folder, its
marker (``COMPLETE``) as written, and its files (the node's own part and its replicas) with
their sizes. ``ptcluster collect``'s node program, and the listing a rank's ``load`` makes of
its own node (``checkpoint.layout.list_node``): one reading of the layout for both.

Standard library only (shipped). It answers one frame and ends.

  stdin  line 2  JSON config (``CkptConfig``): {"dir": DIR, "workdir": WORKDIR} (DIR relative
                 to WORKDIR unless absolute; a leading ~ is this node's home)
  stdout         frames of ``node.wire``: ``hello``, then ``ckpt {root, steps}`` or ``error``
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import TypedDict

from ptcluster.node.wire import Kind, encode, hello

MARKER = "COMPLETE"
"""The marker a step folder holds once the step is complete and replicated."""
STEP_RE = re.compile(r"^step-(\d+)$")
REPLICA_PREFIX = "replica-of-"
TMP_SUFFIX = ".tmp"
MARKER_LIMIT = 1 << 20
"""The most of a marker read (a marker lists files: kilobytes)."""


def part_files(folder: str) -> list[str]:
    """The files of a step folder, or of a replica folder in it: regular files, not the
    marker, not a file still being written (``.tmp``), sorted."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    return sorted(e.name for e in entries if e.is_file(follow_symlinks=False)
                  and e.name != MARKER and not e.name.endswith(TMP_SUFFIX))


def read_marker(folder: str) -> str | None:
    try:
        fd = os.open(os.path.join(folder, MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, MARKER_LIMIT).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


class StepHeld(TypedDict):
    """One step folder a node holds (:func:`list_steps`), as ``checkpoint.layout.holdings``
    reads it."""

    step: int
    marker: str | None
    """The step's marker (its manifest), where it has one."""
    files: dict[str, list[str | int]]
    """``{name: [path relative to the root, size]}`` (a name in both the own part and a
    replica: the own part's)."""


class CkptConfig(TypedDict):
    """The program's config line (``checkpoint.collect`` writes it)."""

    dir: str
    workdir: str


class CkptAnswer(TypedDict, total=False):
    """The ``ckpt`` frame: the directory asked for and what it holds (``missing``: why it
    could not be read), checked by the head as it arrives (``remote.node_replies.CKPT``: the
    same keys)."""

    root: str
    steps: list[StepHeld]
    missing: str


def list_steps(root: str) -> list[StepHeld]:
    """Every step folder under ``root``, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    steps = sorted((int(m.group(1)) for m in map(STEP_RE.match, names) if m), reverse=True)
    out: list[StepHeld] = []
    for step in steps:
        rel = f"step-{step}"
        folder = os.path.join(root, rel)
        subs = [rel]
        try:
            subs += sorted(rel + "/" + e.name for e in os.scandir(folder)
                           if e.name.startswith(REPLICA_PREFIX) and e.is_dir(follow_symlinks=False))
        except OSError:
            continue
        files: dict[str, list[str | int]] = {}
        for sub in subs:
            for name in part_files(os.path.join(root, sub)):
                try:
                    size = os.lstat(os.path.join(root, sub, name)).st_size
                except OSError:
                    continue
                files.setdefault(name, [sub + "/" + name, size])
        out.append({"step": step, "marker": read_marker(folder), "files": files})
    return out


def root_of(cfg: CkptConfig) -> str:
    path = os.path.expanduser(str(cfg["dir"]))
    if os.path.isabs(path):
        return path
    return os.path.join(os.path.expanduser(str(cfg.get("workdir") or ".")), path)


def main() -> int:
    cfg: CkptConfig = json.loads(sys.stdin.readline())
    sys.stdout.buffer.write(hello("ckpt-list"))
    root = os.path.abspath(root_of(cfg))
    answer: CkptAnswer = {"root": root, "steps": []}
    try:
        st = os.stat(root)
    except OSError as exc:
        answer["missing"] = exc.strerror or str(exc)
        sys.stdout.buffer.write(encode(Kind.CKPT, answer))
    else:
        if st.st_uid != os.getuid():
            sys.stdout.buffer.write(encode(Kind.ERROR, {
                "problem": f"{root} belongs to uid {st.st_uid}, not this user",
                "fix": "collect a checkpoint directory of yours"}))
        else:
            answer["steps"] = list_steps(root)
            sys.stdout.buffer.write(encode(Kind.CKPT, answer))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
