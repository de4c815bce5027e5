"""The one way to the terminal: text made safe to show, Rich consoles, and run's console.

What ptcluster shows holds text it did not write: what nodes say (facts, refusals, stderr), other
users' lease records, ssh's last words. A terminal takes escape sequences in that text as
orders: erase a line, move the cursor, show a link that says one thing and opens another. So
all text passes :func:`clean` on its way out, at the writers of ``cli/``: :func:`terminal`
(every Rich console: tables, reports, summaries), :func:`say` (a plain line),
``ConsoleFeed.note`` (run's status lines), and the error line and log handler of
``cli/__init__``. ``ConsoleFeed.line`` writes what it is given: a rank's own output line goes
out as the rank wrote it, colors and carriage returns included (the user's own); a node's own
line (ssh's, torchrun's) is cleaned first by run's sink (``run_cmd.line_sink``).

Cleaned at the exit, not where the text comes in: the same text is data elsewhere (a node's
/etc/hosts that setup writes back, a record ``kill`` matches), and there are fewer ways out than
ways in. Rich markup is off on these consoles: a markup string is only ever ours, with every
value in it escaped (``rich.markup.escape``). ``tests/unit/test_terminal.py`` holds ``cli/`` to
all of this.

``ConsoleFeed`` queues lines for a writer thread; when the terminal cannot keep up (a paused
pager, a flood of output) the queue stays bounded and lines are skipped with a count ("N lines
not shown, see rank3.log") — the job never waits.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import click
from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.text import Text

_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colors, erase, cursor moves
    r"|\x1b[\]PX^_][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"  # OSC (links, title), DCS...: to BEL/ST
    r"|\x1b[ -/]*[0-~]"  # any other escape, and the start of one never ended
    r"|\x9b[0-?]*[ -/]*[@-~]"  # CSI as one C1 character
    r"|[\x90\x98\x9d-\x9f][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)")  # C1's string controls
"""Escape sequences, whole: removed, so that no part of one is left to show."""
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""C0 but tab and newline, DEL, C1, and the bidirectional overrides (text shown in another
order than it is read: "Trojan Source")."""


def clean(text: str) -> str:
    """``text`` as it may reach a terminal: escape sequences removed (a link's text stays, its
    target goes), every other control character shown as U+FFFD. Tab and newline stay (text of
    several lines: stacks, command output); a newline can add a line, never take one back.
    Idempotent; text without a control character is returned as it is (the common case)."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub("\ufffd", _SEQUENCE.sub("", text))


class _Cleaned(Console):
    """A Rich console whose every rendered character of text passes :func:`clean` (the cursor
    moves and erases Rich itself makes, control segments, stay). A string (a table's cell) is
    cleaned before it is laid out too, so that its columns fit what is shown."""

    def render_str(self, text: str, **options: Any) -> Text:
        return super().render_str(clean(text), **options)

    def render(self, renderable: RenderableType,
               options: ConsoleOptions | None = None) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            if segment.control or not _CONTROL.search(segment.text):
                yield segment
            else:
                yield Segment(clean(segment.text), segment.style)


def terminal(*, stderr: bool = False, **options: Any) -> Console:
    """A Rich console for ``cli/`` (the only way one is made there): text cleaned on its way
    out, no markup and no highlighting unless asked (``print(..., markup=True)`` with every
    value escaped)."""
    options.setdefault("highlight", False)
    options.setdefault("markup", False)
    return _Cleaned(stderr=stderr, **options)


def say(text: str, *, err: bool = False) -> None:
    """One plain line (or a few) to stdout or stderr (``err``), cleaned."""
    click.echo(clean(text), err=err)


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
        """A status line: said by ptcluster, but with nodes' and other users' words in it
        (a refusal names the job that holds a GPU): cleaned."""
        self._items.append(("err", clean(text)))
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
