"""A node program's frames to the head, written together: output held a moment, the rest at once.

Standard library only; shipped with the guard (shipped by ``remote.bootstrap``).

The head reads every write of every node: a guard that wrote each rank's line as it came cost
the head a read (a wake-up, a pass of its hub, a decode) per line, 8 per node a second at one
line a second per rank, where one write would carry all 8. So output frames (``o``/``e``/``a``)
are held up to ``hold`` seconds (the head's config: longer on larger clusters, like its
heartbeats) and go out in one write, with the next control frame or when the hold is up,
whichever comes first. Control frames (a rank's exit, heartbeats, ``stopping``) go at once, with
the output held before them in front: the order of frames is never changed, so a rank's last
lines still reach the head before its exit.
"""

import threading
import time
from typing import Any

HOLD_BYTES = 65536
"""Output held reaching this many bytes goes at once (memory stays bounded at any rate)."""


class Outbox:
    """Frames to the head through ``write`` (called with whole frames, never concurrently)."""

    def __init__(self, write: Any, hold: float) -> None:
        self._write = write
        self.hold = hold
        self._lock = threading.Lock()
        self._held: list[bytes] = []
        self._size = 0
        self._due: float | None = None

    def later(self, data: bytes, came: float | None = None) -> None:
        """Output frames: written within ``hold`` s of when they ``came`` (monotonic clock;
        default now), or sooner with other frames."""
        with self._lock:
            if self.hold <= 0:
                self._write(data)
                return
            self._held.append(data)
            self._size += len(data)
            due = (time.monotonic() if came is None else came) + self.hold
            if self._due is None or due < self._due:
                self._due = due
            if self._size >= HOLD_BYTES:
                self._flush(b"")

    def now(self, data: bytes) -> None:
        """A control frame: written at once, after whatever output is held."""
        with self._lock:
            self._flush(data)

    def due(self) -> float | None:
        """Seconds until the held output must go (0 when it is late); None when none is held."""
        due = self._due
        return None if due is None else max(0.0, due - time.monotonic())

    def flush_due(self) -> None:
        """Write the held output if its hold is up (the owner's loop calls this)."""
        with self._lock:
            if self._due is not None and time.monotonic() >= self._due:
                self._flush(b"")

    def flush(self) -> None:
        with self._lock:
            self._flush(b"")

    def _flush(self, tail: bytes) -> None:
        if self._held:
            tail = b"".join(self._held) + tail
            self._held, self._size, self._due = [], 0, None
        if tail:
            self._write(tail)
