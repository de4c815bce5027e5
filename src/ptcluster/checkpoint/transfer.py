"""Files from rank to rank through the checkpoint's gloo group (``place.py`` says why that
group): chunks of at most ``CHUNK`` bytes as uint8 tensors, sent and received at once (a ring's
every node sends to its next while receiving from its previous). Both ends know every file's
size beforehand (from a gather of the metadata), so nothing but the bytes is sent. A received
file is written beside its final name, fsynced, checked against its sha256, then renamed: a
kill leaves no partial file under a final name.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from ptcluster.checkpoint.layout import TMP_SUFFIX, fsync_dir

CHUNK = 16 << 20


@dataclass(frozen=True)
class Outgoing:
    path: Path
    size: int


@dataclass(frozen=True)
class Incoming:
    path: Path
    """Its final name."""
    size: int
    sha256: str


def _chunks(sizes: list[int]) -> list[tuple[int, int]]:
    """(file index, length) of every chunk, in order; an empty file has none."""
    return [(i, min(CHUNK, size - off)) for i, size in enumerate(sizes)
            for off in range(0, size, CHUNK)]


class _Sink:
    """Incoming files, written chunk by chunk; each checked and renamed when its last byte
    came. After a failure (a full disk, bytes that do not match) it only drains what comes:
    the sender must not be left blocked; the failure is said after the exchange."""

    def __init__(self, files: list[Incoming]) -> None:
        self.files, self.done = files, [0] * len(files)
        self.open: dict[int, tuple[IO[bytes], Any]] = {}
        self.error: str | None = None
        for i, f in enumerate(files):
            if f.size == 0:
                self._guarded(self._empty, i)

    def _empty(self, i: int) -> None:
        self._open(i)
        self._finish(i)

    def _guarded(self, fn: Any, *args: Any) -> None:
        if self.error is not None:
            return
        try:
            fn(*args)
        except OSError as exc:
            self.error = f"{exc}"
            self.close()

    def _open(self, i: int) -> tuple[IO[bytes], Any]:
        if i not in self.open:
            path = self.files[i].path
            path.parent.mkdir(parents=True, exist_ok=True)
            self.open[i] = (open(path.with_name(path.name + TMP_SUFFIX), "wb"), hashlib.sha256())
        return self.open[i]

    def write(self, i: int, data: bytearray) -> None:
        self._guarded(self._write, i, data)

    def _write(self, i: int, data: bytearray) -> None:
        f, digest = self._open(i)
        f.write(data)
        digest.update(data)
        self.done[i] += len(data)
        if self.done[i] == self.files[i].size:
            self._finish(i)

    def _finish(self, i: int) -> None:
        f, digest = self.open.pop(i)
        f.flush()
        os.fsync(f.fileno())
        f.close()
        target = self.files[i].path
        tmp = target.with_name(target.name + TMP_SUFFIX)
        if digest.hexdigest() != self.files[i].sha256:
            tmp.unlink(missing_ok=True)
            raise OSError(f"{target.name}: received bytes do not match its sha256")
        os.replace(tmp, target)
        fsync_dir(target.parent)

    def close(self) -> None:
        """Close what is open; a file not finished is removed (never left under a name)."""
        for i, (f, _) in list(self.open.items()):
            f.close()
            path = self.files[i].path
            path.with_name(path.name + TMP_SUFFIX).unlink(missing_ok=True)
        self.open.clear()


class _Source:
    """Outgoing files, chunk by chunk. A file that cannot be read (gone, changed) is sent as
    zeros, so the receiver is never left blocked; its sha256 then fails there, and the failure
    is said here after the exchange."""

    def __init__(self, files: list[Outgoing]) -> None:
        self.files = files
        self.readers: dict[int, io.BufferedReader] = {}
        self.error: str | None = None

    def read(self, i: int, n: int) -> bytearray:
        buf = bytearray(n)
        try:
            if i not in self.readers:
                self.readers[i] = open(self.files[i].path, "rb")
            if self.readers[i].readinto(buf) != n:
                raise OSError(f"{self.files[i].path} changed while it was being sent")
        except OSError as exc:
            self.error = self.error or f"{exc}"
        return buf

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def exchange(group: Any, dst: int | None, outgoing: list[Outgoing], src: int | None,
             incoming: list[Incoming]) -> str | None:
    """Send ``outgoing`` to rank ``dst`` while receiving ``incoming`` from rank ``src``; what
    failed at this end (None: nothing). Both ends always move every byte they agreed on, so a
    failure at one end never leaves the other blocked."""
    outs = _chunks([o.size for o in outgoing]) if dst is not None else []
    ins = _chunks([i.size for i in incoming]) if src is not None else []
    sink, source = _Sink(incoming if src is not None else []), _Source(outgoing)
    try:
        for j in range(max(len(outs), len(ins))):
            works, got = [], None
            if j < len(outs):
                buf = source.read(*outs[j])
                works.append(dist.isend(torch.frombuffer(buf, dtype=torch.uint8), dst,
                                        group=group))
            if j < len(ins):
                got = bytearray(ins[j][1])
                works.append(dist.irecv(torch.frombuffer(got, dtype=torch.uint8), src,
                                        group=group))
            for w in works:
                assert w is not None  # None only for a rank outside the group
                w.wait()
            if got is not None:
                sink.write(ins[j][0], got)
    finally:
        source.close()
        sink.close()
    return source.error or sink.error
