"""Output of a command that reaches a node, read with a cap (L4): the last :data:`CAP` bytes of
each stream are kept and the rest is read and dropped, so a node that streams gigabytes into
its ssh's stdout or stderr costs the head no memory. The lines of stdout are counted whole
(rsync's ``--out-format=%n`` names every file it sent)."""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass
from typing import IO

CAP = 64 * 1024
CHUNK = 1 << 16


class Tail:
    """The last ``cap`` bytes of a stream, and how many of its lines are not empty and do not
    end in ``/`` (rsync's names of directories)."""

    def __init__(self, cap: int = CAP) -> None:
        self.cap, self.data, self.lines, self._last = cap, bytearray(), 0, b""

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.cap:
            del self.data[:-self.cap]
        *ended, rest = chunk.split(b"\n")
        for part in ended:
            last = part[-1:] or self._last
            self.lines += bool(last) and last != b"/"
            self._last = b""
        self._last = rest[-1:] or self._last

    def read_all(self, stream: IO[bytes]) -> None:
        for chunk in iter(lambda: stream.read1(CHUNK), b""):  # type: ignore[attr-defined]
            self.add(chunk)

    def value(self) -> bytes:
        return bytes(self.data[-self.cap:])


@dataclass(frozen=True)
class Captured:
    returncode: int
    stdout: bytes
    stderr: bytes
    stdout_lines: int
    """stdout's lines that are not empty and do not end in ``/`` (all of them, not only the
    kept ones)."""


def collect(proc: subprocess.Popen[bytes], timeout: float,
            stdin: bytes | None = None) -> Captured:
    """``proc``'s stdout and stderr (pipes) read to their end, capped; ``stdin`` written to it
    from a thread. On a timeout ``proc`` is killed and TimeoutExpired raised."""
    tails = (Tail(), Tail())
    readers = [threading.Thread(target=t.read_all, args=(s,), daemon=True)
               for t, s in zip(tails, (proc.stdout, proc.stderr), strict=True) if s is not None]
    if stdin is not None and proc.stdin is not None:
        readers.append(threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True))
    for r in readers:
        r.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        for r in readers:
            r.join(10.0)  # (a grandchild that keeps the pipe open: not waited on for ever)
    return Captured(code, tails[0].value(), tails[1].value(), tails[0].lines)


def _feed(stdin: IO[bytes], data: bytes) -> None:
    try:
        stdin.write(data)
        stdin.close()
    except OSError:  # (it exited without reading all: its status says why)
        pass


def run(argv: list[str], timeout: float, stdin: bytes | None = None) -> Captured:
    """``argv`` run to its end (stdin: ``stdin``, else nothing), its output capped."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with proc:
        return collect(proc, timeout, stdin)
