"""Processes by tree, never by name: the guard's view of what its job left on the node.

Standard library only; shipped with the guard (shipped by ``remote.bootstrap``).
"""

import ctypes
import os
import threading
from typing import Any

PR_SET_CHILD_SUBREAPER = 36


def libc_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_subreaper(on: bool = True) -> None:
    """The guard adopts what its job's processes orphan (``on``); off only while it starts a
    warm pool that must not be its own (``guard.warm_pool``)."""
    prctl = libc_prctl()
    if prctl is None or prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _proc_table() -> list[tuple[int, int, str]]:
    """(pid, ppid, state) of every process we can see."""
    table = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # The command name may hold spaces and ')': fields start after the last ')'.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1:
            table.append((int(entry), int(fields[1]), fields[0]))
    return table


def children_map() -> dict[int, list[int]]:
    """Every live (non-zombie) process's children, by parent pid."""
    children: dict[int, list[int]] = {}
    for pid, ppid, state in _proc_table():
        if state != "Z":
            children.setdefault(ppid, []).append(pid)
    return children


class RankTrees:
    """Every pid each rank's tree had (the shim, its program, their children: a process the
    kernel killed is gone when we look), kept while the job runs; shared by the machine's
    watches (``guard.machine``), each under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.roots: dict[int, int] = {}
        """Per rank: its program's pid."""
        self.trees: dict[int, set[int]] = {}
        """Per rank: every pid its tree had."""

    def started(self, rank: int, pid: int, shim_pid: int) -> None:
        """A rank's program started (its pid, its shim's)."""
        with self.lock:
            self.trees.setdefault(rank, set()).update(p for p in (pid, shim_pid) if p > 0)
            self.roots[rank] = pid

    def scan(self, roots: dict[int, int]) -> None:
        """Each rank's tree now (``roots``: rank -> its program's pid), added to what it had."""
        children = children_map()
        for rank, root in roots.items():
            tree, todo = [root], [root]
            while todo:
                kids = children.get(todo.pop(), [])
                tree += kids
                todo += kids
            with self.lock:
                self.trees.setdefault(rank, set()).update(tree)


def descendants(root: int, spare: int = 0) -> list[int]:
    """Live (non-zombie) processes below ``root``, but ``spare`` and what is below it."""
    children = children_map()
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            if pid != spare:
                out.append(pid)
                todo.append(pid)
    return out


def signal_tree(root: int, sig: int, spare: int = 0) -> None:
    for pid in descendants(root, spare):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def reap_others(keep: int) -> None:
    """Reap re-parented orphans (we are a subreaper) without stealing the child's status."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == keep:
            return  # nothing to reap, or the child itself: Popen.poll() collects that one
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            return


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
