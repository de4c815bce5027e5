"""A run's logs (``RunLogs``): each rank's lines to ``rankN.log`` and each node's own lines
(torchrun's agent, ssh, the head's notes about the node) to ``nodeI-HOST.log`` in the run
directory (``ptcluster.rundir`` names them), files readable by the owner only, a few times a
second through a bounded pool of open files, and keeps the last lines of each rank for the
summary; ``log_files_budget`` sizes that pool from the open-file limit.
"""

from __future__ import annotations

import os
import resource
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path

from ptcluster.errors import PtclusterError
from ptcluster.node.problems import Declared
from ptcluster.node.sharing import safefile
from ptcluster.rundir import RunDir

LAST_LINES = 40


class DescriptorLimitError(PtclusterError):
    """The head cannot hold a channel per node within its open-file limit (checked before
    anything starts)."""


PIPES_PER_NODE = 3
"""A node channel's descriptors in the head: the program's stdin, stdout and stderr."""
HEAD_RESERVE = 64
"""Descriptors for everything else of the head (its stdio, the control socket, the channels'
selector, run files, the stacks collector, a library's own)."""
MIN_LOG_FILES = 8
MAX_LOG_FILES = 1 << 16
OPEN_FILES_LIMIT = Declared(
    "run.open-files-limit", "too few open files for the head's channels",
    "a job on {nodes} nodes needs {need} open files on this machine ({per_node} per node for "
    "its channel, {rest} for the rest), and the limit here is {soft}",
    "raise it: `ulimit -n {need}` (up to the hard limit, `ulimit -Hn`; above that, as root: "
    "`nofile` in /etc/security/limits.conf, or LimitNOFILE= for a service)")


def log_files_budget(nodes: int) -> int:
    """How many log files the head may keep open for a job of ``nodes`` nodes, within its
    soft open-file limit (``ptcluster`` raised it to the hard one at start); raises
    :class:`DescriptorLimitError` with what is needed when even a few do not fit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_LOG_FILES
    spare = soft - PIPES_PER_NODE * nodes - HEAD_RESERVE
    if spare < MIN_LOG_FILES:
        need = PIPES_PER_NODE * nodes + HEAD_RESERVE + MIN_LOG_FILES
        raise DescriptorLimitError.of(OPEN_FILES_LIMIT, nodes=nodes, need=need,
                                      per_node=PIPES_PER_NODE,
                                      rest=HEAD_RESERVE + MIN_LOG_FILES, soft=soft)
    return min(MAX_LOG_FILES, spare)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class RunLogs:
    """Lines are kept in memory per file and written by ``flush`` (the runner calls it on a
    fixed timer and at the end): one write per file that got lines, through a bounded pool of
    open files (``max_open``, least recently written closed first), so a job of 1024 nodes x 8
    ranks fits a small descriptor limit, and the work per line is an append.

    A log that cannot be opened or written (no descriptors left, a full disk) never stops
    what comes after its line in the same batch (a rank's exit, a heartbeat): the error is kept
    once per file (``errors``, said through ``on_error``), the lines it misses are counted
    (``lost``), and the rank's last lines are still kept for the summary."""

    def __init__(self, run_dir: Path, on_error: Callable[[str], None] | None = None,
                 max_open: int = 256) -> None:
        self.run_dir = run_dir
        self.on_error = on_error or (lambda text: None)
        self.max_open = max(1, max_open)
        self.errors: dict[str, str] = {}
        """File -> the first error writing it."""
        self.lost: dict[str, int] = {}
        """File -> lines that did not reach it."""
        self._open: OrderedDict[str, int] = OrderedDict()
        """The pool: open descriptors (written with ``os.write``: one system call per file
        and flush, no buffer layers), least recently written first."""
        self._pending: dict[str, list[str]] = {}
        self._dirty: list[str] = []
        self._rank_pending: dict[int, list[str]] = {}
        self._opened: set[str] = set()
        """Files opened in this attempt (they have its banner)."""
        self._created: set[str] = set()
        """Files this run made (only those are ever opened again)."""
        self._dir: int | None = None
        """The run directory's descriptor (checked ours alone), while files are open."""
        self.tails: dict[int, deque[str]] = {}
        self.node_tails: dict[str, deque[str]] = {}
        self.banner = ""
        """Written first into every file opened in this attempt (a restart's marker)."""

    def new_attempt(self, banner: str) -> None:
        """From now on a restart's lines: each file gets ``banner`` before them; the last
        lines kept for the summary start again."""
        self.close()
        self.banner = banner
        self._opened.clear()
        self.tails.clear()
        self.node_tails.clear()

    def rank_line(self, rank: int, text: str) -> None:
        """Once per line of the job: a few lookups and two appends."""
        pending, tail = self._rank_pending.get(rank), self.tails.get(rank)
        if pending is None:
            pending = self._rank_pending[rank] = self._lines(RunDir.rank_log_name(rank))
        if tail is None:  # (new for this attempt)
            tail = self.tails[rank] = deque(maxlen=LAST_LINES)
        tail.append(text)
        if not pending:
            self._dirty.append(RunDir.rank_log_name(rank))
        pending.append(text)

    def node_line(self, node_rank: int, host: str, text: str) -> None:
        tail = self.node_tails.get(host)
        if tail is None:
            tail = self.node_tails[host] = deque(maxlen=LAST_LINES // 2)
        tail.append(text)
        name = RunDir.node_log_name(node_rank, host)
        pending = self._lines(name)
        if not pending:
            self._dirty.append(name)
        pending.append(text)

    def tail(self, rank: int) -> list[str]:
        return list(self.tails.get(rank, ()))

    def node_tail(self, host: str) -> list[str]:
        return list(self.node_tails.get(host, ()))

    def flush(self) -> None:
        """Every file that got lines since the last flush: its lines, in one write."""
        dirty, self._dirty = self._dirty, []
        for name in dirty:
            pending = self._pending[name]
            pending.append("")  # (the last line's newline)
            data = "\n".join(pending).encode(errors="replace")
            count = len(pending) - 1
            pending.clear()
            fd = self._file(name)
            if fd is not None:
                try:
                    _write_all(fd, data)
                    continue
                except OSError as exc:
                    self._failed(name, exc)
                    self._drop(name)
            self.lost[name] = self.lost.get(name, 0) + count

    def close(self) -> None:
        self.flush()
        for name in list(self._open):
            self._drop(name)
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None

    def _lines(self, name: str) -> list[str]:
        pending = self._pending.get(name)
        if pending is None:
            pending = self._pending[name] = []
        return pending

    def _file(self, name: str) -> int | None:
        """The open file (now the most recently written), or None (said once) when it cannot
        be opened."""
        fd = self._open.get(name)
        if fd is not None:
            self._open.move_to_end(name)
            return fd
        while len(self._open) >= self.max_open:
            self._drop(next(iter(self._open)))
        try:
            fd = self._open_file(name)
        except OSError as exc:
            self._failed(name, exc)
            return None
        self._open[name] = fd
        if name not in self._opened:
            self._opened.add(name)
            if self.banner:
                try:
                    _write_all(fd, (self.banner + "\n").encode(errors="replace"))
                except OSError as exc:
                    self._failed(name, exc)
                    self._drop(name)
                    return None
        return fd

    def _open_file(self, name: str) -> int:
        """``name`` opened to append: made now (``O_EXCL``) the first time, after that only
        the file this run made (never a link, never another user's)."""
        if self._dir is None:
            self._dir = safefile.open_dir(str(self.run_dir), others=0o022)
        flags = os.O_WRONLY | os.O_APPEND
        if name in self._created:
            return safefile.open_regular(name, flags, self._dir, owners=(os.getuid(),))
        fd = safefile.create_new(name, 0o600, self._dir, flags)
        self._created.add(name)
        return fd

    def _drop(self, name: str) -> None:
        fd = self._open.pop(name, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError as exc:
                self._failed(name, exc)

    def _failed(self, name: str, exc: OSError) -> None:
        if name not in self.errors:
            self.errors[name] = f"{name}: {exc.strerror or exc}"
            self.on_error(f"cannot write {self.errors[name]}: its lines are missing from the log "
                          "(the console and the summary's last lines still have them)")
