"""The terminal of ``ptcluster run``: a console that may lag, decoupled from the job.

``ConsoleFeed`` queues lines for a writer thread; when the terminal cannot keep up (a paused
pager, a flood of output) the queue stays bounded and lines are skipped with a count ("N lines
not shown, see rank3.log") — the job never waits.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class ConsoleFeed:
    """A bounded, non-blocking path to the terminal, drained by its own thread.

    ``write_out(text)`` gets the job's lines, ``write_err(text)`` the notes (status lines); both
    may block or raise ``BrokenPipeError`` (then that stream is closed and what would go there
    is only in the logs). Notes are never dropped; job lines are, beyond ``capacity``, counted
    per source and replaced by one line that says how many and where they are. ``line`` takes
    no lock on its common path (it runs once per line of the job).
    """

    def __init__(self, write_out: Callable[[str], None], write_err: Callable[[str], None],
                 capacity: int = 20000) -> None:
        self._writers = {"out": write_out, "err": write_err}
        self.capacity = capacity
        self._items: deque[tuple[str, str]] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._dropped: dict[str, int] = {}
        self.dropped_total = 0
        self.broken: set[str] = set()
        self._closing = False
        self._thread = threading.Thread(target=self._drain, name="console", daemon=True)
        self._thread.start()

    def line(self, text: str, source: str) -> None:
        """A job line; ``source`` names where it is logged (for the "not shown" note)."""
        if "out" in self.broken:
            return
        if len(self._items) >= self.capacity:
            with self._lock:
                self._dropped[source] = self._dropped.get(source, 0) + 1
                self.dropped_total += 1
        else:
            self._items.append(("out", text))
        if not self._wake.is_set():
            self._wake.set()

    def note(self, text: str) -> None:
        self._items.append(("err", text))
        self._wake.set()

    def close(self, timeout: float) -> None:
        """Let the writer finish what is queued, for at most ``timeout`` seconds."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    def _drain(self) -> None:
        while True:
            if not self._closing:
                self._wake.wait()
            self._wake.clear()
            batch: list[tuple[str, str]] = []
            try:
                while True:
                    batch.append(self._items.popleft())
            except IndexError:
                pass
            with self._lock:
                dropped, self._dropped = self._dropped, {}
            batch += [("out", f"ptcluster: {n} line(s) not shown (the console fell behind), "
                              f"see {source}") for source, n in sorted(dropped.items())]
            if batch:
                self._write_batch(batch)
            elif self._closing:
                return

    def _write_batch(self, batch: list[tuple[str, str]]) -> None:
        start = 0
        while start < len(batch):
            stream = batch[start][0]
            end = start
            while end < len(batch) and batch[end][0] == stream:
                end += 1
            if stream not in self.broken:
                try:
                    self._writers[stream]("".join(text + "\n" for _, text in batch[start:end]))
                except OSError:  # BrokenPipeError included: that stream is gone
                    self.broken.add(stream)
            start = end
