"""A run directory's layout (``RunDir``: every file named once) and how its files are written.

Below both ``launch/`` (the head that writes a run directory) and ``control/`` (the commands
that read it: ``stacks``, ``kill``, ``monitor``): names and safe writes, nothing of a plan or
a result (``launch.plan.plan_json`` and ``RunResult.to_json`` make what is written; the logs
are ``launch.runlogs``).

A run directory holds every ``env:`` value and the job's output, and ``--run-dir`` (or the
current directory) may be somewhere shared: it is made new, mode 0700, in a parent that is
ours and that no one else can change (else the run is refused: whoever can write the parent
can swap the run directory for theirs), and every file
in it is opened through a descriptor of the directory, checked to be ours and changed by no
one else, without following a link (``node.sharing.safefile``): new files ``O_EXCL``, rewritten ones
renamed into place.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ptcluster.errors import PtclusterError
from ptcluster.node.problems import Declared
from ptcluster.node.sharing import safefile
from ptcluster.node.sharing.records import valid_job_id

DEFAULT_RUNS_DIR = "ptcluster-runs"
"""Where run directories go unless ``--run-dir`` says otherwise (relative: the current one)."""


class RunDirError(PtclusterError):
    """The run directory cannot be created or written (checked before anything starts)."""


RUN_DIR_EXISTS = Declared(
    "run.run-dir-exists", "the run directory exists already",
    "the run directory {path} exists already (not made by this run)",
    "pass --run-dir with a directory of yours")
RUN_DIR_UNWRITABLE = Declared(
    "run.run-dir-unwritable", "the run directory cannot be written",
    "cannot write the run directory {path}: {error}",
    "pass --run-dir with a directory of yours that others cannot write")


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

    def create(self, attempt: int, plan: dict[str, Any]) -> None:
        """The directory, new and ours alone (0700), in a parent of ours that no one else can
        change, with the first plan (``launch.plan.plan_json``) in it; or :class:`RunDirError`
        (before anything starts)."""
        try:
            make_private(self.path)
            self.write_plan(attempt, plan)
        except FileExistsError:
            raise RunDirError.of(RUN_DIR_EXISTS, path=self.path) from None
        except OSError as exc:
            raise RunDirError.of(RUN_DIR_UNWRITABLE, path=self.path,
                                 error=exc.strerror or exc) from None

    def write_plan(self, attempt: int, plan: dict[str, Any]) -> None:
        """An attempt's plan as shipped (``launch.plan.plan_json``), its own file."""
        write_private(self.plan_file(attempt), json.dumps(plan, indent=2))

    def write_summary(self, summary: dict[str, Any]) -> None:
        """The run's outcome (``RunResult.to_json``)."""
        write_private(self.summary, json.dumps(summary, indent=2))


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
