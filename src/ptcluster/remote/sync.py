"""Copy the project from the head's directory to every node's workdir (``ptcluster sync``,
``run --sync``).

What is copied: in a git checkout the files ``git ls-files -co --exclude-standard`` lists
(tracked, and untracked but not ignored), else every file less what ``.gitignore`` excludes and
the folders whose own ``.gitignore`` ignores them whole (a runs folder ptcluster made, a venv);
never ``.git``. How: rsync over the same ssh options the cluster file gives (only what changed
crosses the network), or, on a node without rsync, tar over ssh (everything, every time). Nodes
are synced in parallel; one failing never stops the others.
"""

from __future__ import annotations

import fnmatch
import os
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ptcluster.cluster.model import ClusterSpec, NodeSpec
from ptcluster.errors import Problem
from ptcluster.remote import capped
from ptcluster.remote.transport import remote_command, ssh_argv

NO_RSYNC = 4
"""Exit status of the node's probe when it has no rsync."""


@dataclass
class SyncResult:
    host: str
    method: str = ""
    """``rsync`` or ``tar``."""
    sent: int = 0
    """Files copied (rsync: only the changed ones; tar: all)."""
    seconds: float = 0.0
    problem: Problem | None = None
    """Why the node is not synced (who: None, the node is ``host``)."""

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_json(self) -> dict[str, Any]:
        """``sync --json``'s record of the node: the problem as its what and fix."""
        said = self.problem
        return {"host": self.host, "method": self.method, "sent": self.sent,
                "seconds": self.seconds, "problem": None if said is None else said.what,
                "fix": None if said is None else said.fix}


def project_files(root: Path) -> list[str]:
    """The files to copy, relative to ``root``, sorted."""
    git = shutil.which("git")
    if git:
        inside = subprocess.run([git, "-C", str(root), "rev-parse", "--is-inside-work-tree"],
                                capture_output=True, text=True)
        if inside.returncode == 0 and inside.stdout.strip() == "true":
            out = subprocess.run([git, "-C", str(root), "ls-files", "-z", "-co",
                                  "--exclude-standard"], capture_output=True, check=True).stdout
            names = {n for n in out.decode().split("\0") if n}
            return sorted(n for n in names if ".git" not in Path(n).parts
                          and (root / n).is_file())
    return _walk(root, _gitignore(root))


def _gitignore(root: Path) -> list[str]:
    try:
        lines = (root / ".gitignore").read_text().splitlines()
    except OSError:
        return []
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(rel: str, is_dir: bool, patterns: list[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    for pat in patterns:
        if pat.endswith("/"):
            if not is_dir:
                continue
            pat = pat.rstrip("/")
        anchored = pat.startswith("/") or "/" in pat.rstrip("/")
        pat = pat.lstrip("/")
        if (fnmatch.fnmatch(rel, pat) if anchored else fnmatch.fnmatch(name, pat)):
            return True
    return False


def _ignores_all(folder: Path) -> bool:
    """``folder``'s own ``.gitignore`` ignores everything in it (``*``: a runs folder, a venv)."""
    return "*" in _gitignore(folder)


def _walk(root: Path, patterns: list[str]) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if d != ".git"
                       and not _ignored(rel_dir + d, True, patterns)
                       and not _ignores_all(Path(dirpath) / d)]
        out += [rel_dir + f for f in filenames if not _ignored(rel_dir + f, False, patterns)]
    return sorted(out)


def remote_dir(workdir: str) -> str:
    """The workdir as the node's login shell sees it: ``~/x`` becomes ``x`` (relative to the
    home, where ssh starts), so no ``~`` needs expanding."""
    if workdir == "~":
        return "."
    if workdir.startswith("~/"):
        return workdir[2:] or "."
    return workdir


def _ssh_e(node: NodeSpec) -> str:
    argv = ssh_argv(node.host, node.ssh)
    assert argv[-2:] == ["--", node.host]
    return shlex.join(argv[:-2])


def sync_node(node: NodeSpec, root: Path, files: list[str], *, timeout: float = 3600) -> SyncResult:
    begun = time.monotonic()
    result = SyncResult(host=node.host)
    dest = remote_dir(node.workdir)
    probe = capped.run(
        ssh_argv(node.host, node.ssh) + [remote_command(
            ["sh", "-c", 'mkdir -p -- "$1" || exit 3; command -v rsync >/dev/null || exit 4',
             "sync", dest])], timeout=60)
    if probe.returncode not in (0, NO_RSYNC):
        tail = probe.stderr.decode(errors="replace").strip().splitlines()[-1:] or [
            f"exit status {probe.returncode}"]
        result.problem = Problem(None, f"cannot prepare {node.workdir} over ssh ({tail[0]})",
                                 "check ssh to the node (`ptcluster doctor`) and that workdir is "
                                 "writable")
        return result
    listing = "\0".join(files).encode() + b"\0"
    if probe.returncode != NO_RSYNC and shutil.which("rsync"):
        result.method = "rsync"
        proc = capped.run(
            # -s (--protect-args, rsync >= 3.0): the paths go to the node's rsync over its own
            # protocol, never through the node's shell (rsync < 3.2.4 and RSYNC_OLD_ARGS=1 hand
            # them to it as they are: a ';' in the workdir ran a command there)
            ["rsync", "-a", "-s", "--from0", "--files-from=-", "--out-format=%n", "-e",
             _ssh_e(node), f"{root}/", f"{_rsync_host(node.host)}:{dest}/"],
            timeout, stdin=listing)
        result.sent = proc.stdout_lines
    else:
        result.method = "tar"
        remote = remote_command(["sh", "-c", 'mkdir -p -- "$1" && tar -C "$1" -xf -', "sync",
                                 dest])
        proc = tar_pipe(root, listing, ssh_argv(node.host, node.ssh) + [remote], timeout)
        result.sent = len(files)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [
            f"exit status {proc.returncode}"]
        result.problem = Problem(None, f"{result.method} to {node.workdir} failed ({err[0]})",
                                 "check the workdir is writable on the node and has space")
    result.seconds = round(time.monotonic() - begun, 2)
    return result


def tar_pipe(root: Path, listing: bytes, receiver: list[str],
             timeout: float) -> capped.Captured:
    """``tar -c`` of the NUL-separated ``listing`` under ``root`` into ``receiver``'s stdin.

    The receiver starts before the listing is written, and the listing goes in from a thread:
    tar reads names as it archives, so with a long listing (more than a pipe's 64 KiB) tar
    blocks on a full stdout while we block on its full stdin, unless something drains it.
    On a timeout both processes are killed (TimeoutExpired is raised, as ``subprocess.run``)."""
    tar = subprocess.Popen(["tar", "-C", str(root), "-cf", "-", "--null", "-T", "-"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert tar.stdin is not None and tar.stdout is not None
    try:
        recv = subprocess.Popen(receiver, stdin=tar.stdout, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    except OSError:
        tar.kill()
        tar.wait()
        raise
    tar.stdout.close()  # the receiver holds it: tar gets SIGPIPE should the receiver die

    def feed(stdin: IO[bytes]) -> None:
        try:
            stdin.write(listing)
            stdin.close()
        except OSError:  # tar is gone: its exit status says why
            pass

    feeder = threading.Thread(target=feed, args=(tar.stdin,), daemon=True)
    feeder.start()
    try:
        got = capped.collect(recv, timeout)  # (a node's output: capped, L4)
    except subprocess.TimeoutExpired:
        tar.kill()
        raise
    finally:
        if recv.returncode is not None and recv.returncode != 0:
            tar.kill()  # nobody reads its output any more
        code = tar.wait()
        feeder.join()
    returncode = recv.returncode
    if code != 0 and returncode == 0:
        returncode = 1
    return capped.Captured(returncode, got.stdout, got.stderr, got.stdout_lines)


def sync_project(spec: ClusterSpec, root: Path | None = None,
                 on_done: Callable[[SyncResult], None] | None = None) -> list[SyncResult]:
    """Sync ``root`` (default: the current directory) to every node and spare, in parallel."""
    root = (root or Path.cwd()).resolve()
    files = project_files(root)
    results = {n.host: SyncResult(host=n.host) for n in spec.machines}

    def one(node: NodeSpec) -> None:
        try:
            results[node.host] = sync_node(node, root, files)
        except (OSError, subprocess.SubprocessError) as exc:
            results[node.host].problem = Problem(None, f"sync failed: {exc}",
                                                 "check ssh to the node (`ptcluster doctor`)")
        if on_done is not None:
            on_done(results[node.host])

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in spec.machines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[n.host] for n in spec.machines]


def _rsync_host(host: str) -> str:
    """rsync's ``HOST:PATH`` with an IPv6 address: the address in brackets."""
    return f"[{host}]" if ":" in host else host
