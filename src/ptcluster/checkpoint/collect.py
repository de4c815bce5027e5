"""``ptcluster collect``: a job's checkpoint, from the nodes' disks to one folder on the head.

Every node is asked what it holds of the checkpoint directory (``node.ckpt_list``, over the
node channel); the newest step some node marked complete whose every file some node holds (or
the step asked for) is chosen as a rank's ``load`` chooses (``layout.choose``); each file comes
from one node that holds it, by ``tar`` over the same transport as everything else (ssh, an
srun step, or this machine), and is checked against the marker's sha256 before it takes its
name. The folder is one DCP checkpoint: ``torch.distributed.checkpoint.load`` reads it in a
single process with no process group. Standard library only (no torch on the head).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptcluster.checkpoint import layout
from ptcluster.cluster.model import ClusterSpec, NodeSpec
from ptcluster.errors import Problem, PtclusterError
from ptcluster.node import CKPT_LIST
from ptcluster.node.ckpt_list import CkptConfig
from ptcluster.node.problems import Declared
from ptcluster.node.wire import Kind
from ptcluster.remote.connect import transport
from ptcluster.remote.group import Member, ask_all
from ptcluster.remote.node_replies import ckpt_answer
from ptcluster.remote.replies import BadReply

LIST_TIMEOUT = 30.0
"""Seconds every node has to say what it holds."""
CHUNK = 1 << 20


@dataclass
class Collected:
    """What ``collect`` did."""

    step: int
    dest: Path
    files: int = 0
    bytes: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    """Files taken from each node (by host)."""
    unreachable: list[Problem] = field(default_factory=list)
    """Nodes that did not answer (the checkpoint was complete without them)."""

    def to_json(self) -> dict[str, Any]:
        """``collect --json``: the step, where it went, the figures, and each node not asked
        (who, what, and its code and fields)."""
        return {"step": self.step, "dest": str(self.dest), "files": self.files,
                "bytes": self.bytes, "sources": self.sources,
                "unreachable": [{"who": p.who, "what": p.what, "code": p.code,
                                 "fields": p.fields} for p in self.unreachable]}


NO_NODE_ANSWERED = Declared(
    "checkpoint.no-node-answered", "no node answered collect", "no node answered ({said})",
    "check the nodes with `ptcluster doctor`")
NOTHING_TO_COLLECT = Declared(
    "checkpoint.nothing-to-collect", "no complete checkpoint to collect",
    "nothing to collect from {dir}: {why}",
    "check DIR is the dir the job passed to save (relative to the workdir) and that a save "
    "completed (`ptcluster.checkpoint.wait`)")
TABLE = (NO_NODE_ANSWERED, NOTHING_TO_COLLECT)
"""What ``collect`` refuses (``checkpoint.*`` codes)."""


def collect(spec: ClusterSpec, dir: str, dest: Path, step: int | None = None,
            on_file: Callable[[str, str, int], None] | None = None) -> Collected:
    """Gather the checkpoint into ``dest``; ``on_file(host, name, size)`` after each file.
    Raises ``PtclusterError`` when no node holds a complete one (or ``step``)."""
    hosts, listings, roots, unreachable = _ask(spec, dir)
    if not hosts:
        raise PtclusterError.of(NO_NODE_ANSWERED, said="; ".join(map(str, unreachable)))
    choice, why = layout.choose(listings, step)
    if choice is None:
        raise PtclusterError.of(NOTHING_TO_COLLECT, dir=dir, why=why)
    files = choice.manifest.files()
    for name in files:
        if name != os.path.basename(name) or name in ("", ".", ".."):
            raise PtclusterError(f"the marker of step {choice.manifest.step} names a file "
                                 f"{name!r} that is not a plain file name", None)
    dest.mkdir(parents=True, exist_ok=True)
    done = Collected(choice.manifest.step, dest, unreachable=unreachable)
    by_node: dict[int, list[str]] = {}
    for name in sorted(files):
        by_node.setdefault(choice.holders[name][0], []).append(name)
    for node, names in sorted(by_node.items()):
        held = next(h for h in listings[node] if h.step == choice.manifest.step)
        paths = {held.files[name][0]: name for name in names}
        _fetch(spec, hosts[node], roots[node], paths, files, dest, done, on_file)
    layout.write_atomic(dest / layout.MARKER, choice.manifest.to_bytes())
    return done


def _ask(spec: ClusterSpec, dir: str) -> tuple[list[str], list[list[layout.Holding]],
                                                list[str], list[Problem]]:
    def config(n: NodeSpec) -> CkptConfig:
        return {"dir": dir, "workdir": n.workdir}

    members = [Member(n.host, transport(spec, n), n.python, config(n)) for n in spec.nodes]
    result = ask_all(members, CKPT_LIST, Kind.CKPT, LIST_TIMEOUT)
    hosts, listings, roots = [], [], []
    unreachable = [r.problem.by(host) if r.problem else Problem(host, str(r.why))
                   for host, r in result.failed.items()]
    for host, answered in result.succeeded.items():
        try:
            frame = ckpt_answer(answered.answers[Kind.CKPT])
        except BadReply as exc:  # that node's failure, named
            unreachable.append(exc.problem.by(host))
            continue
        hosts.append(host)
        roots.append(frame["root"])
        listings.append(layout.holdings(frame.get("steps") or []))
    return hosts, listings, roots, unreachable


def _fetch(spec: ClusterSpec, host: str, root: str, paths: dict[str, str],
           files: dict[str, list], dest: Path, done: Collected,
           on_file: Callable[[str, str, int], None] | None) -> None:
    """``paths`` (relative to ``root`` on ``host`` -> the name in ``dest``) by one ``tar``."""
    node = next(n for n in spec.nodes if n.host == host)
    argv = transport(spec, node).argv(["tar", "-C", root, "-cf", "-", "--", *sorted(paths)])
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stderr is not None
    got: set[str] = set()
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                name = paths.get(member.name)
                source = tar.extractfile(member) if member.isfile() else None
                if name is None or name in got or source is None:
                    continue  # never written by the member's own name: only names we asked
                size, sha = files[name]
                _write(source, dest / name, size, sha, host)
                got.add(name)
                done.files, done.bytes = done.files + 1, done.bytes + size
                done.sources[host] = done.sources.get(host, 0) + 1
                if on_file is not None:
                    on_file(host, name, size)
    except tarfile.TarError as exc:
        raise PtclusterError(f"{host}: reading the files from {root} failed ({exc})",
                             "check the node's disk and ssh to it") from exc
    finally:
        proc.kill()
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
        proc.wait()
    missing = sorted(set(paths.values()) - got)
    if missing:
        raise PtclusterError(f"{host}: {len(missing)} file(s) of {root} did not come "
                             f"({missing[0]} ...; {err[-1] if err else 'no error said'})",
                             "check the node's disk, or collect while no save runs")


def _write(source: object, target: Path, size: int, sha: str, host: str) -> None:
    """``source``'s bytes at ``target``: beside it first, checked, then renamed."""
    tmp = target.with_name(target.name + layout.TMP_SUFFIX)
    digest, n = hashlib.sha256(), 0
    with open(tmp, "wb") as out:
        while chunk := source.read(CHUNK):  # type: ignore[attr-defined]
            digest.update(chunk)
            out.write(chunk)
            n += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    if n != size or digest.hexdigest() != sha:
        tmp.unlink(missing_ok=True)
        raise PtclusterError(f"{host}: {target.name} does not match the checkpoint's marker "
                             f"({n} bytes, {size} expected, or another sha256)",
                             "the node's copy changed after the save: collect another step "
                             "(--step)")
    os.replace(tmp, target)
