"""A run directory: its layout (``RunDir``, every file named once) and its logs (``RunLogs``).

A run directory holds every ``env:`` value and the job's output, and ``--run-dir`` (or the
current directory) may be somewhere shared: it is made new, mode 0700, in a parent that is
ours and that no one else can change (else the run is refused: whoever can write the parent
can swap the run directory for theirs), and every file
in it is opened through a descriptor of the directory, checked to be ours and changed by no
one else, without following a link (``node.sharing.safefile``): new files ``O_EXCL``, rewritten ones
renamed into place.

``RunLogs`` writes each rank's lines to ``rankN.log`` and each node's own lines (torchrun's
agent, ssh, the head's notes about the node) to ``nodeI-HOST.log``, files readable by the owner
only, a few times a second through a bounded pool of open files, and keeps the last lines of
each rank for the summary; ``log_files_budget`` sizes that pool from the open-file limit.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ptcluster.errors import PtclusterError
from ptcluster.node.problems import Declared
from ptcluster.node.sharing import safefile
from ptcluster.node.sharing.records import valid_job_id

if TYPE_CHECKING:  # (types only: the control socket's clients read names here, nothing more)
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.plan import LaunchPlan
    from ptcluster.launch.result import RunResult

DEFAULT_RUNS_DIR = "ptcluster-runs"
"""Where run directories go unless ``--run-dir`` says otherwise (relative: the current one)."""
LAST_LINES = 40


class RunDirError(PtclusterError):
    """The run directory cannot be created or written (checked before anything starts)."""


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


RUN_DIR_EXISTS = Declared(
    "run.run-dir-exists", "the run directory exists already",
    "the run directory {path} exists already (not made by this run)",
    "pass --run-dir with a directory of yours")
RUN_DIR_UNWRITABLE = Declared(
    "run.run-dir-unwritable", "the run directory cannot be written",
    "cannot write the run directory {path}: {error}",
    "pass --run-dir with a directory of yours that others cannot write")


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


@dataclass(frozen=True)
class RunDir:
    """The layout of one run directory: the one place its files are named (as torch's
    ``DefaultLogsSpecs`` owns its own), for the head that writes them and for the commands
    that read them (``stacks``, ``kill``, ``monitor``, the console's hints)."""

    path: Path

    PLAN: ClassVar[str] = "plan.json"
    """The first attempt's plan as shipped (``plan_json``); a restart's is ``plan.N.json``."""
    SUMMARY: ClassVar[str] = "summary.json"
    """The run's outcome (``RunResult.to_json``), written when the head ends."""
    CONTROL_SOCKET: ClassVar[str] = "control.sock"
    """Where a running head listens (``control.server``)."""
    HANG_STACKS: ClassVar[str] = "hang-stacks"
    """Every rank's stacks when the job was found hung (``.txt`` and ``.json``)."""

    @staticmethod
    def rank_log_name(rank: int) -> str:
        return f"rank{rank}.log"

    @staticmethod
    def node_log_name(node_rank: int, host: str) -> str:
        """A node's own lines: torchrun's agent, ssh, the head's notes about the node."""
        return f"node{node_rank}-{host}.log"

    @staticmethod
    def stacks_stem(ident: int, clock: str) -> str:
        """A report asked by ``ptcluster stacks`` (``clock``: HHMMSS) without its suffix."""
        return f"stacks-{clock}-{ident}"

    def rank_log(self, rank: int) -> Path:
        return self.path / self.rank_log_name(rank)

    def plan_file(self, attempt: int = 0) -> Path:
        return self.path / (self.PLAN if attempt == 0 else f"plan.{attempt}.json")

    @property
    def summary(self) -> Path:
        return self.path / self.SUMMARY

    @property
    def control_socket(self) -> Path:
        return self.path / self.CONTROL_SOCKET

    def stacks_report(self, stem: str) -> tuple[Path, Path]:
        """(text, JSON) of the stacks report ``stem`` (``HANG_STACKS`` or ``stacks_stem``)."""
        return self.path / f"{stem}.txt", self.path / f"{stem}.json"

    def create(self, plan: LaunchPlan, opts: RunOptions) -> None:
        """The directory, new and ours alone (0700), in a parent of ours that no one else can
        change, with the first plan in it; or :class:`RunDirError` (before anything starts)."""
        try:
            make_private(self.path)
            self.write_plan(plan, opts)
        except FileExistsError:
            raise RunDirError.of(RUN_DIR_EXISTS, path=self.path) from None
        except OSError as exc:
            raise RunDirError.of(RUN_DIR_UNWRITABLE, path=self.path,
                                 error=exc.strerror or exc) from None

    def write_plan(self, plan: LaunchPlan, opts: RunOptions) -> None:
        """``plan_json`` of ``plan`` (an attempt's own file)."""
        write_private(self.plan_file(plan.attempt),
                      json.dumps(plan_json(plan, opts), indent=2))

    def write_summary(self, result: RunResult) -> None:
        write_private(self.summary, json.dumps(result.to_json(), indent=2))


def plan_json(plan: LaunchPlan, opts: RunOptions) -> dict[str, Any]:
    """The plan as shipped: per node, the guard's whole config (configuration only: the code
    travels in the guard's program)."""
    data: dict[str, Any] = {k: v for k, v in asdict(plan).items() if k != "nodes"}
    data["options"] = asdict(opts)
    data["nodes"] = []
    for node in plan.nodes:
        cfg = node.guard_config(plan, opts)
        data["nodes"].append({"host": node.host, "node_rank": node.node_rank,
                              "ranks": [node.ranks.start, node.ranks.stop - 1],
                              "python": node.python, "guard": cfg})
    return data


def run_dir_for(job_id: str, base: str | Path | None) -> Path:
    """The run directory of job ``job_id`` under ``base`` (``--run-dir``) or the default."""
    if not valid_job_id(job_id):
        raise ValueError(f"{job_id[:80]!r} is not a job id")
    return Path(base or DEFAULT_RUNS_DIR) / job_id


IGNORE_ALL = "# made by ptcluster: run directories (logs, plans, summaries) are not source\n*\n"
"""The ``.gitignore`` of a runs folder ptcluster makes: git, and so ``sync``, leaves it out (a
project's ``ptcluster-runs/`` was copied to every node by each ``run --sync``, and showed in
``git status``), as a venv's own ``.gitignore`` does."""


def runs_parent(path: Path) -> int:
    """A descriptor of ``path``, where run directories are made: made (0700) where missing,
    with a ``.gitignore`` that ignores it all (``IGNORE_ALL``: a folder the user made keeps what
    it has); refused (OSError) unless it is ours and no one else can change it (whoever can
    write it can swap a run directory for theirs)."""
    made = not path.exists()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:  # (not a directory: not "the run directory exists already")
        raise NotADirectoryError(errno.ENOTDIR, f"{path} is not a directory") from None
    fd = safefile.open_dir(str(path), others=0o022, follow=True)
    if made:
        try:
            with open(safefile.create_new(".gitignore", 0o644, fd), "w") as f:
                f.write(IGNORE_ALL)
        except FileExistsError:  # another head made the folder at the same moment
            pass
    return fd


def make_private(path: Path) -> None:
    """``path`` made new, ours alone (0700), in a :func:`runs_parent` (FileExistsError when it
    is there already, OSError when its parent is not safe)."""
    parent = runs_parent(path.parent)
    try:
        os.mkdir(path.name, 0o700, dir_fd=parent)
    finally:
        os.close(parent)


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (the plan holds every ``env:`` value; reports and
    the summary hold the job's output), in a directory of ours that no one else can change
    (OSError else; that only we can put names in it is what matters, ``RunDir.create`` makes
    it 0700): a new file renamed over the old one, so what was there (a link, a file not ours)
    is replaced, never written through, and a reader sees the old text or the new, not half."""
    dir_fd = safefile.open_dir(str(path.parent), others=0o022)
    tmp = f".{path.name}.{secrets.token_hex(4)}"
    try:
        with open(safefile.create_new(tmp, 0o600, dir_fd), "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    finally:
        os.close(dir_fd)


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
