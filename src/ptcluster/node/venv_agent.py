"""The node side of the project's environment (``venvs``): which wheels and environment this
node has, the missing wheels received, the environment built, checked, listed and pruned.

Shipped like every node program (``remote.bootstrap``) and run by the node's ``python:`` (setup's
venv, whose torch and ptcluster the environment sees beneath its own packages). Standard library
only. Where things live: ``node.venv_store``.

  stdin  line 2   JSON config: ``{root, silence}`` (root default ``~/.ptcluster``; silence:
                  seconds without a byte from the head after which it ends as at ``stop``)
  stdout          after ``hello``: ``facts {python, machine, glibc, free}`` (what to resolve for)
                  ``have {digest, wheels: [sha256]}`` -> ``have {missing, env, why, python,
                  machine, glibc, free, path, addr}`` (addr: where ssh reached this node)
                  ``blob {sha256, size}`` then exactly ``size`` raw bytes: stored under its
                  sha256 once verified (nothing answered; a failure is kept for ``build``)
                  relay (``node.data_relay``, as push's): ``relay {bind, secret, peer}`` ->
                  ``relay {port}``: the wheels come from the upstream node instead; ``link
                  {addr, port, secret}`` -> ``link {ok}``: each wheel received is passed on
                  ``build {digest, resolved}`` -> ``build {ok, python, built, seconds}`` (once
                  the relay's wheels are all in), or ``{ok: false, what, fix, code, fields,
                  lacking}`` (``venv_problems``; a wheel that did not arrive: ``blobs``' words,
                  no code; lacking: a wheel is missing or did not arrive whole, which the head
                  may send again)
                  ``check {digest, wheels}`` -> ``check {findings, python}``
                  ``venvs {}`` -> ``venvs {envs}``; ``prune {keep, max_bytes}`` -> ``prune {...}``
                  ``bye``: end once what was asked is done; ``stop`` or EOF: end now (a build
                  in progress is killed, its folder removed)

Wheel bytes travel raw on the channel itself (after their ``blob`` line): the one transport every
connector has (ssh, srun, local), each wheel once to each node that lacks it; base64 in JSON
would send a third more. From 3 nodes the head sends each wheel once, to the first node of a
chain, and each node passes it on to the next (``node.data_relay``: the relay of ``ptcluster
push``); a wheel a node has already is passed on, not written again.
"""

import errno
import fcntl
import glob
import json
import os
import platform
import queue
import secrets
import shutil
import signal
import site
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from typing import BinaryIO, TypedDict

from ptcluster.node.blobs import HeadStream, free_bytes, pass_on, receive, remove_parts
from ptcluster.node.data_relay import Relay, ssh_address
from ptcluster.node.guard.proctree import libc_prctl
from ptcluster.node.problems import Sent
from ptcluster.node.sharing.safefile import remove_tree
from ptcluster.node.venv_problems import (
    BUILD_STOPPED,
    BUILD_UNWRITABLE,
    CHANGED_IN_USE,
    DISK_FULL,
    INSTALL_FAILED,
    NEVER_BUILT,
    WHEEL_NOT_STORED,
)
from ptcluster.node.venv_store import (
    BUILD_PREFIX,
    GRACE,
    LOCK_PREFIX,
    MANIFEST,
    disk_problem,
    dist_version,
    env_state,
    full_check,
    listing,
    manifest_files,
    mark_used,
    prune,
    site_packages,
    uses,
)
from ptcluster.node.wire import Kind, control, encode, hello, split

PR_SET_PDEATHSIG = 1
LAYER = "_ptcluster_layer.pth"
"""The file in an environment's site-packages that appends setup's venv's site-packages (torch,
ptcluster) after its own: the project's packages first, torch and ptcluster beneath."""


class VenvsConfig(TypedDict, total=False):
    """The program's config line (``venvs.nodes.members`` writes it, ``venvs.ship.ship`` adds
    its defaults)."""

    root: str
    """The user's ptcluster directory here (default ``~/.ptcluster``)."""
    silence: float
    """Seconds without a byte from the head after which it ends as at ``stop`` (0 or absent:
    never)."""
    addr: str | None
    """Where the other nodes reach this one (the relay's; read by the head's ``remote.relay``,
    not here; None: as the node's ``have`` says)."""


class Node:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.store = os.path.join(self.root, "store", "sha256")
        self.envs = os.path.join(self.root, "envs")
        for d in (self.root, self.store, self.envs, os.path.join(self.root, "uses")):
            os.makedirs(d, mode=0o700, exist_ok=True)
        remove_parts(self.store, dead_too=True)  # (what a program killed mid-wheel left)
        self.failed: dict[str, Sent] = {}
        """Wheels that did not arrive whole: sha256 -> the problem, sent."""
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.building: str | None = None
        self.cancelled = False
        self.relay = Relay(self.receive)
        """This node's place in the relay's chain (none: its wheels come from the head)."""

    # -- have ---------------------------------------------------------------------------------
    def env_dir(self, digest: str) -> str:
        return os.path.join(self.envs, digest)

    def env_state(self, digest: str) -> tuple[str, str]:
        """("ok" | "missing" | "changed", why): ``venv_store.env_state``."""
        return env_state(self.env_dir(digest))

    def platform(self) -> dict:
        """What the head resolves for: this interpreter's version, the machine, glibc's; and
        the torch and ptcluster the environment is layered on (this interpreter's: setup's),
        which a lock must not pin otherwise ("" where absent)."""
        libc, version = platform.libc_ver()
        return {"python": f"{sys.version_info[0]}.{sys.version_info[1]}",
                "machine": platform.machine(), "glibc": version if libc == "glibc" else "",
                "free": free_bytes(self.root), "torch": dist_version("torch"),
                "ptcluster": dist_version("ptcluster")}

    def have(self, msg: dict) -> dict:
        digest = msg["digest"]
        state, why = self.env_state(digest)
        if state == "ok":
            mark_used(self.root, digest)
        missing = [s for s in msg.get("wheels", [])
                   if not os.path.isfile(os.path.join(self.store, s))]
        return {"digest": digest, "env": state, "why": why, "missing": missing,
                **self.platform(), "path": os.path.join(self.env_dir(digest), "bin", "python"),
                "addr": ssh_address()}

    # -- blobs --------------------------------------------------------------------------------
    def receive(self, stream: BinaryIO, msg: dict) -> None:
        """Exactly ``size`` bytes from ``stream`` (the head's channel or the upstream node's;
        always all of them: the stream stays in step), stored as ``store/sha256/HEX`` when
        their digest is ``sha256``, each block passed on down the relay as it comes (a wheel
        this node has already: passed on only)."""
        sha, size = str(msg["sha256"]), int(msg["size"])
        final = os.path.join(self.store, sha)
        self.relay.announce(msg)
        if os.path.isfile(final):
            pass_on(stream, size, self.relay.forward)
            return
        problem = receive(stream, sha, size, final, DISK_FULL, tee=self.relay.forward)
        if problem is None:
            self.failed.pop(sha, None)
        else:
            self.failed[sha] = problem

    # -- build --------------------------------------------------------------------------------
    def build(self, msg: dict) -> dict:
        digest, resolved = msg["digest"], msg["resolved"]
        self.relay.finish()  # (the relay's wheels all in, or its upstream gone)
        begun = time.monotonic()
        for w in [*resolved["wheels"], *resolved["tools"]]:
            if w["sha256"] in self.failed:  # (blobs' file.* or venvs.disk-full, sent)
                return {"digest": digest, "ok": False, "lacking": True,
                        **self.failed[w["sha256"]]}
            if not os.path.isfile(os.path.join(self.store, w["sha256"])):
                return {"digest": digest, "ok": False, "lacking": True,
                        **WHEEL_NOT_STORED.sent(filename=w["filename"])}
        lock = os.open(os.path.join(self.envs, LOCK_PREFIX + digest),
                       os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another job's build of it: wait for it
            for left in glob.glob(os.path.join(self.envs, f"{BUILD_PREFIX}{digest}-*")):
                remove_tree(left)  # a build whose program was killed (its lock is ours now)
            state, why = self.env_state(digest)
            built = state != "ok"
            if built:
                running = uses(self.root).get(digest)
                if state == "changed" and running:  # never removed under a running job
                    users = ", ".join(r if r.startswith("warm pool") else f"job {r}"
                                      for r in running)
                    return {"digest": digest, "ok": False,
                            **CHANGED_IN_USE.sent(why=why, users=users)}
                if state == "changed":  # never used: put aside, removed, built anew
                    aside = os.path.join(self.envs, f"{BUILD_PREFIX}stale-{digest}-"
                                         f"{secrets.token_hex(4)}")
                    os.rename(self.env_dir(digest), aside)
                    remove_tree(aside)
                answer = self.make(digest, resolved)
                if answer is not None:
                    return {"digest": digest, "ok": False, **answer}
            mark_used(self.root, digest)
        finally:
            os.close(lock)
        return {"digest": digest, "ok": True, "built": built, "rebuilt_why": why,
                "python": os.path.join(self.env_dir(digest), "bin", "python"),
                "seconds": round(time.monotonic() - begun, 3)}

    def make(self, digest: str, resolved: dict) -> Sent | None:
        """Build into ``.build-DIGEST-RAND`` and rename it into place; None when done, else
        the problem (``Declared.sent``; the partial folder removed)."""
        tmp = os.path.join(self.envs, f"{BUILD_PREFIX}{digest}-{secrets.token_hex(4)}")
        with self.lock:
            if self.cancelled:
                return BUILD_STOPPED.sent()
            self.building = tmp
        try:
            problem = self.install(tmp, resolved)
            if problem is None:
                final = self.env_dir(digest)
                relocate(tmp, final)
                write_manifest(tmp, digest, resolved)
                with self.lock:
                    if self.cancelled:
                        problem = BUILD_STOPPED.sent()
                    else:
                        os.rename(tmp, final)
                        self.building = None
        except OSError as exc:
            problem = disk_problem(tmp, exc) if exc.errno in (errno.ENOSPC, errno.EDQUOT) \
                else BUILD_UNWRITABLE.sent(path=tmp, error=exc)
        if problem is not None:
            with self.lock:
                self.building = None
            remove_tree(tmp)
        return problem

    def install(self, tmp: str, resolved: dict) -> Sent | None:
        base = base_python()
        uv = self.uv(resolved["tools"])
        links = tmp + ".links"
        os.mkdir(links, 0o700)
        try:  # the wheels under their real names (uv and pip read tags from the name)
            for w in resolved["wheels"]:
                os.link(os.path.join(self.store, w["sha256"]), os.path.join(links, w["filename"]))
            files = [os.path.join(links, w["filename"]) for w in resolved["wheels"]]
            # uv unpacks each wheel into a cache of this build's own and hard-links the
            # files into the environment (one write of each, not a second copy); the cache
            # is removed after, so the environment's files are its own: no other build or
            # cache shares them (a file changed by hand changes nothing else)
            env = {**os.environ, "UV_CACHE_DIR": tmp + ".cache",
                   "UV_PYTHON_DOWNLOADS": "never", "UV_NO_CONFIG": "1"}
            if uv is not None:
                steps = [[uv, "venv", "--quiet", "--relocatable", "--python", base, tmp]]
                if files:
                    steps.append([uv, "pip", "install", "--quiet", "--offline", "--no-index",
                                  "--no-deps", "--link-mode", "hardlink", "--python",
                                  os.path.join(tmp, "bin", "python"), *files])
            else:
                # pip only where uv cannot serve: no uv wheel for this node's platform came
                # with the environment (uv publishes wheels for the common platforms only)
                steps = [[base, "-m", "venv", "--without-pip", tmp]]
                if files:
                    steps.append([sys.executable, "-m", "pip", "--python",
                                  os.path.join(tmp, "bin", "python"), "install", "--quiet",
                                  "--no-index", "--no-deps", "--no-compile", *files])
            for argv in steps:
                code, out = self.command(argv, env)
                if code != 0:
                    return self.failure(tmp, argv, code, out)
            write_layer(tmp)
        finally:
            remove_tree(links)
            remove_tree(tmp + ".cache")
        return None

    def failure(self, tmp: str, argv: list, code: int, out: str) -> Sent:
        if "No space left" in out or "Disk quota" in out:
            return disk_problem(tmp, OSError(errno.ENOSPC, out.strip().splitlines()[-1]))
        last = out.strip().splitlines()[-1] if out.strip() else f"exit status {code}"
        return INSTALL_FAILED.sent(tool=os.path.basename(argv[0]), step=argv[1], last=last)

    def command(self, argv: list, env: dict) -> tuple[int, str]:
        with self.lock:
            if self.cancelled:
                return 130, "stopped"
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         preexec_fn=dies_with_us())
        out, _ = self.proc.communicate()
        with self.lock:
            code, self.proc = self.proc.returncode, None
        return code, out.decode(errors="replace")

    def uv(self, tools: list) -> str | None:
        """uv, taken from the uv wheel that came with the environment (once per version)."""
        for w in tools:
            if w["name"] != "uv":
                continue
            folder = os.path.join(self.root, "tools", f"uv-{w['version']}")
            path = os.path.join(folder, "uv")
            if os.access(path, os.X_OK):
                return path
            tmp = f"{folder}.{secrets.token_hex(4)}"
            os.makedirs(tmp, 0o700)
            with zipfile.ZipFile(os.path.join(self.store, w["sha256"])) as z:
                name = next(n for n in z.namelist() if n.endswith(".data/scripts/uv"))
                with z.open(name) as src, open(os.path.join(tmp, "uv"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
            os.chmod(os.path.join(tmp, "uv"), 0o755)
            try:
                os.rename(tmp, folder)
            except OSError:  # another build took it there first
                remove_tree(tmp)
            return path
        return None

    def cancel(self) -> None:
        """Stop now (the head is gone, or said stop): the build's command killed (its whole
        group), its folder removed."""
        with self.lock:
            self.cancelled = True
            proc, tmp = self.proc, self.building
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
        if tmp is not None:
            remove_tree(tmp)
            remove_tree(tmp + ".links")
            remove_tree(tmp + ".cache")


def dies_with_us() -> Callable[[], None]:
    """What a build's command does between fork and exec: its own session (``cancel`` kills its
    whole group), and death with this program even on SIGKILL (a node lost mid-build, its
    program killed: no uv left running into a folder no one will use)."""
    prctl, parent = libc_prctl(), os.getpid()  # resolved here: the child stays minimal

    def setup() -> None:
        os.setsid()
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # this program died before the line above
            os._exit(1)

    return setup


def watch_head(node: Node, head: HeadStream, silence: float) -> None:
    """End this program once the head has been silent ``silence`` s (it sends a heartbeat every
    second): a link cut mid-build shows here as silence, never as EOF (the node's sshd keeps
    the session for as long as TCP does), and the head has named this node lost by then. The
    build is stopped and its folder removed, as when the head is interrupted."""
    while True:
        time.sleep(min(1.0, silence / 4))
        if head.silent(silence):
            node.cancel()
            remove_parts(node.store)  # (a wheel on its way: never left half-written)
            os._exit(0)


def base_python() -> str:
    """The interpreter setup's venv was made from (``python -m venv`` from inside a venv makes
    one of the base too): the environment is a venv of it, never of a venv."""
    if sys.prefix == sys.base_prefix:
        return sys.executable
    return getattr(sys, "_base_executable", "") or os.path.join(
        sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")


def write_layer(tmp: str) -> None:
    """The ``.pth`` that puts this interpreter's site-packages (setup's venv: torch, ptcluster)
    after the environment's own; ``addsitedir`` so that their own ``.pth`` files work too (an
    editable install's finder)."""
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs)
    with open(os.path.join(site_packages(tmp), LAYER), "w") as f:
        f.write(line + "\n")


def relocate(tmp: str, final: str) -> None:
    """Scripts whose first line names the build folder's python name the final one instead
    (pip writes absolute shebangs; uv's relocatable venv needs none of this)."""
    bindir = os.path.join(tmp, "bin")
    old, new = f"#!{tmp}/".encode(), f"#!{final}/".encode()
    for name in os.listdir(bindir):
        path = os.path.join(bindir, name)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if data.startswith(old):
            with open(path, "wb") as f:
                f.write(new + data[len(old):])


def write_manifest(tmp: str, digest: str, resolved: dict) -> None:
    record = {"digest": digest, "resolved": resolved, "created": time.time(),
              "base": base_python(), "files": manifest_files(tmp)}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(record, f)


def serve(node: Node, kind: str, msg: dict) -> tuple[str, dict]:
    if kind == Kind.HAVE:
        return kind, node.have(msg)
    if kind == Kind.BUILD:
        return kind, node.build(msg)
    if kind == Kind.CHECK:
        env = node.env_dir(msg["digest"])
        findings = full_check(env, msg.get("wheels", [])) if os.path.isdir(env) else \
            [NEVER_BUILT.sent()]
        return kind, {"digest": msg["digest"], "findings": findings,
                      "python": os.path.join(env, "bin", "python")}
    if kind == Kind.VENVS:
        return kind, {"envs": listing(node.root)}
    return kind, prune(node.root, int(msg.get("keep", 3)), int(msg.get("max_bytes", 20 << 30)),
                       float(msg.get("grace", GRACE)))


def main() -> None:
    stdin = sys.stdin.buffer
    cfg: VenvsConfig = json.loads(stdin.readline())
    out = sys.stdout.buffer
    node = Node(cfg.get("root") or "~/.ptcluster")
    writing = threading.Lock()

    def answer(kind: str, said: dict) -> None:
        with writing:
            out.write(encode(kind, said))
            out.flush()

    out.write(hello("venvs"))
    answer(Kind.FACTS, node.platform())  # (the head resolves for it meanwhile)
    requests: queue.Queue[tuple[str, dict] | None] = queue.Queue()

    def worker() -> None:  # requests in order, off the reading thread: it sees EOF at once
        while (item := requests.get()) is not None:
            kind, msg = item
            try:
                answer_kind, said = serve(node, kind, msg)
            except Exception as exc:  # noqa: BLE001 - one line to the head, never a hang
                answer_kind, said = kind, {"ok": False, "what": f"{type(exc).__name__}: "
                                             f"{exc}", "fix": "report this bug"}
            answer(answer_kind, said)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    head = HeadStream(stdin)
    if cfg.get("silence"):
        threading.Thread(target=watch_head, args=(node, head, float(cfg["silence"])),
                         daemon=True).start()
    try:
        for raw in iter(head.readline, b""):
            kind, payload = split(raw.decode().rstrip("\n"))
            if kind == Kind.BYE:
                requests.put(None)
                thread.join()
                os._exit(0)
            if kind == Kind.STOP:
                break
            if kind == Kind.HB:
                continue
            msg = control(payload)
            if kind == Kind.BLOB:
                node.receive(head, msg)  # type: ignore[arg-type]
            elif kind in (Kind.RELAY, Kind.LINK):  # (quick; before any wheel they concern)
                relay = node.relay
                answer(kind, relay.listen(msg) if kind == Kind.RELAY else relay.link(msg))
            elif kind in (Kind.HAVE, Kind.BUILD, Kind.CHECK, Kind.VENVS, Kind.PRUNE):
                requests.put((kind, msg))
    except EOFError:
        pass
    node.cancel()  # stop, or EOF: the head was interrupted (Ctrl-C) or is gone
    os._exit(0)


if __name__ == "__main__":
    main()
