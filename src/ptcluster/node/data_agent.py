"""The node side of ``ptcluster push``: which of the head's files this node's copy lacks (by
content), the missing ones received, every file's digest reported.

Standard library only; shipped like every node program (``remote.bootstrap``).

  stdin  line 2   JSON config: ``{dest, silence}`` (the folder on this node, made if missing;
                  silence: seconds without a byte from the head after which it ends)
  stdout          ``hello``, then answers:
                  ``have {files: [{path, size, sha256}]}`` -> ``have {ok, missing, free,
                  addr}`` (addr: where ssh reached this node, for the relay)
                  (or ``{ok: false, code, what, fix, fields}``: ``TABLE``'s DEST not
                  writable, too little space)
                  ``blob {sha256, size, path, mtime}`` then exactly ``size`` raw bytes: stored
                  as DEST/path once verified, by a temp name then a rename (``node.blobs``)
                  ``stored {delete}`` -> ``stored {files: {path: sha256}, failed, deleted}``
                  (failed: ``{path: problem}``, each as ``Declared.sent`` gives it)
                  relay (``node.data_relay``): ``relay {bind, secret, peer}`` -> ``relay
                  {port}``: the files come from the upstream node instead; ``link {addr, port,
                  secret}`` -> ``link {ok}``: each file received is passed on to that node
                  ``hb``: the head's heartbeat (every second while it waits)

A head whose link is cut sends no EOF (this node's sshd keeps the session for as long as TCP
does): the program ends itself after ``silence`` s without a byte from it, its temp files
removed. A silence counts only while the node waits for the head (``HeadStream``): never
while it writes a file or passes a block on (a next node behind a cut holds that up to
``data_relay.PEER_LOST`` s: the kernel watches the relay's own links, ``node.data_relay``), and
the long answers (a ``have`` may hash a whole copy; a ``stored`` waits for the upstream node's
last file) are worked out on a thread of their own while the head is read on.

The node keeps a manifest (``DEST/.ptcluster-data.json``: per file its size, mtime and
sha256): a file whose size and mtime are the manifest's is not read again (rsync's quick check),
any other is hashed. Files under DEST that the head does not have are kept unless ``delete``.
"""

import hashlib
import json
import os
import queue
import sys
import threading
import time
import traceback
from typing import BinaryIO, TypedDict

from ptcluster.node.blobs import CHUNK, PART_PREFIX, HeadStream, free_bytes, receive
from ptcluster.node.data_relay import Relay, ssh_address
from ptcluster.node.problems import Declared, Sent
from ptcluster.node.wire import Kind, control, encode, hello, split

MANIFEST = ".ptcluster-data.json"
FREE = "free space on that file system (or push to another --to), then push again"
DEST_UNWRITABLE = Declared(
    "push.dest-unwritable", "the folder pushed to cannot be written on a node",
    "{dest} is not writable here: {error}",
    "push to a folder this user may write (--to), or make that one so")
NO_ROOM = Declared(
    "push.no-room", "a node has less space free than the files it lacks",
    "the disk is full at {dest}: {need} bytes to store, {free} bytes free", FREE)
DISK_FULL = Declared(
    "push.disk-full", "a node's disk filled as a file arrived",
    "the disk is full at {path} ({free} bytes free): {error}", FREE)
TABLE = (DEST_UNWRITABLE, NO_ROOM, DISK_FULL)
"""Why a node refuses or fails a push (beside ``node.blobs``' ``file.*``); push names the node."""


class _Config(TypedDict):
    dest: str
    """The folder on this node (made if missing)."""


class PushConfig(_Config, total=False):
    """The program's config line (``push.send.members_for`` writes it, ``push.send.push`` adds
    its default ``silence``)."""

    silence: float
    """Seconds without a byte from the head after which it ends (0 or absent: never)."""
    addr: str | None
    """Where the other nodes reach this one (the relay's; read by the head's ``remote.relay``,
    not here; None: as the node's ``have`` says)."""


def inside(path: str) -> bool:
    """``path`` names a file below DEST (relative, no ``..``)."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and "" not in parts


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


class Dest:
    def __init__(self, dest: str) -> None:
        self.dest = os.path.abspath(os.path.expanduser(dest))
        self.manifest: dict[str, dict] = {}
        self.failed: dict[str, Sent] = {}
        self.wanted: list[str] = []
        self.relay = Relay(self.receive)
        """This node's place in the relay's chain (none: its files come from the head)."""

    def have(self, msg: dict) -> dict:
        files = msg["files"]
        self.wanted = [f["path"] for f in files if inside(f["path"])]
        problem = self.prepare()
        if problem is not None:
            return {"ok": False, **problem}
        self.manifest = self.load()
        missing, need = [], 0
        for f in files:
            if self.digest(f["path"]) != f["sha256"]:
                missing.append(f["path"])
                need += int(f["size"])
        self.save()
        free = free_bytes(self.dest)
        if 0 <= free < need:
            return {"ok": False, **NO_ROOM.sent(dest=self.dest, need=need, free=free)}
        return {"ok": True, "missing": missing, "free": free, "addr": ssh_address()}

    def prepare(self) -> Sent | None:
        """DEST made if missing and writable by this user; earlier pushes' temp files gone."""
        try:
            os.makedirs(self.dest, exist_ok=True)
            probe = os.path.join(self.dest, f"{PART_PREFIX}probe-{os.getpid()}")
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(probe)
        except OSError as exc:
            return DEST_UNWRITABLE.sent(dest=self.dest, error=exc.strerror or exc)
        self.remove_parts()
        return None

    def remove_parts(self) -> None:
        """Every temp file under DEST (an earlier push's, or this one's as it ends)."""
        for top, _dirs, names in os.walk(self.dest):
            for name in names:
                if name.startswith(PART_PREFIX):
                    try:
                        os.unlink(os.path.join(top, name))
                    except OSError:
                        pass

    def load(self) -> dict[str, dict]:
        try:
            with open(os.path.join(self.dest, MANIFEST)) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def save(self) -> None:
        final = os.path.join(self.dest, MANIFEST)
        tmp = f"{final}.{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(self.manifest, f)
            os.rename(tmp, final)
        except OSError:  # (a manifest that could not be written: the next push hashes again)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def digest(self, path: str) -> str | None:
        """The sha256 of DEST/path as it is now (None: no such regular file)."""
        if not inside(path):
            return None
        full = os.path.join(self.dest, path)
        try:
            st = os.stat(full)
            if not os.path.isfile(full):
                return None
            entry = self.manifest.get(path)
            if entry and entry.get("size") == st.st_size and \
                    entry.get("mtime_ns") == st.st_mtime_ns:
                return str(entry["sha256"])
            sha = sha256_of(full)
        except OSError:
            return None
        self.manifest[path] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
        return sha

    def receive(self, stdin: BinaryIO, msg: dict) -> None:
        """One file, from the head or the upstream node, passed on as it comes in a relay."""
        path, sha = str(msg["path"]), str(msg["sha256"])
        final = os.path.join(self.dest, path) if inside(path) else os.path.join(self.dest, ".")
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
        except OSError:
            pass  # (the file's open fails then, and says why)
        self.relay.announce(msg)
        problem = receive(stdin, sha, int(msg["size"]), final, DISK_FULL, 0o644,
                          self.relay.forward)
        if problem is not None:
            self.failed[path] = problem
            return
        self.failed.pop(path, None)
        if msg.get("mtime") is not None:
            os.utime(final, ns=(int(msg["mtime"]), int(msg["mtime"])))
        st = os.stat(final)
        self.manifest[path] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}

    def stored(self, msg: dict) -> dict:
        self.relay.finish()  # the relay's files all in (or its upstream gone)
        files = {p: self.digest(p) for p in self.wanted}
        deleted = self.delete() if msg.get("delete") else 0
        self.save()
        return {"files": files, "failed": self.failed, "deleted": deleted}

    def delete(self) -> int:
        """The files under DEST that the head does not have, removed (``--delete``)."""
        keep, gone = set(self.wanted), 0
        for top, _dirs, names in os.walk(self.dest):
            for name in names:
                rel = os.path.relpath(os.path.join(top, name), self.dest)
                if rel != MANIFEST and rel not in keep:
                    try:
                        os.unlink(os.path.join(top, name))
                        self.manifest.pop(rel, None)
                        gone += 1
                    except OSError:
                        pass
        return gone


def watch_head(node: Dest, head: HeadStream, silence: float) -> None:
    """End this program once the head has been silent ``silence`` s (it sends a heartbeat every
    second): a link cut mid-push shows here as silence, never as EOF. This push's temp files go
    with it (a file on its way is never left half-written under its name)."""
    while True:
        time.sleep(min(1.0, silence / 4))
        if head.silent(silence):
            node.relay.end_downstream()
            node.remove_parts()
            os._exit(0)


def main() -> None:
    stdin = sys.stdin.buffer
    cfg: PushConfig = json.loads(stdin.readline())
    out = sys.stdout.buffer
    writing = threading.Lock()

    def answer(kind: str, said: dict) -> None:
        with writing:
            out.write(encode(kind, said))
            out.flush()

    node = Dest(str(cfg["dest"]))
    with writing:
        out.write(hello("push"))
        out.flush()
    head = HeadStream(stdin)
    if cfg.get("silence"):
        threading.Thread(target=watch_head, args=(node, head, float(cfg["silence"])),
                         daemon=True).start()
    asked: queue.Queue[tuple[str, dict]] = queue.Queue()

    def work() -> None:  # (one request at a time, in order: the head waits for each answer)
        try:
            while True:
                kind, msg = asked.get()
                answer(kind, node.have(msg) if kind == Kind.HAVE else node.stored(msg))
        except BaseException:  # noqa: BLE001 - a bug: the head sees this node end, and why
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=work, daemon=True).start()
    try:
        for raw in iter(head.readline, b""):
            kind, payload = split(raw.decode().rstrip("\n"))
            if kind in (Kind.BYE, Kind.STOP):
                break
            if kind == Kind.BLOB:
                node.receive(head, control(payload))  # type: ignore[arg-type]
            elif kind in (Kind.HAVE, Kind.STORED):  # (long: hashing, the upstream's files)
                asked.put((kind, control(payload)))
            elif kind in (Kind.RELAY, Kind.LINK):  # (quick; before any file they concern)
                msg = control(payload)
                relay = node.relay
                answer(kind, relay.listen(msg) if kind == Kind.RELAY else relay.link(msg))
    except EOFError:
        pass  # the head was interrupted (Ctrl-C) or is gone: the file on its way was removed
    os._exit(0)


if __name__ == "__main__":
    main()
