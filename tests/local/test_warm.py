"""``run --warm``: ranks forked from a per-user pool with torch imported (``node/warm/``,
``node/guard/warm_ranks.py``), on this machine, real processes: a warm rank sees what a cold
one sees, an edit takes effect, the pool ends (idle timeout, ``warm stop``, SIGKILL) leaving no
process, and another user is refused."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.head import Head, by_rank, only_run, run_head

pytestmark = pytest.mark.slow

SHOW = textwrap.dedent("""
    import os, resource, signal, sys
    PER_JOB = {"MASTER_PORT", "PET_LOG_DIR", "PTCLUSTER_GUARD_SOCK", "PTCLUSTER_JOB_ID",
               "PTCLUSTER_SHIM", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}
    for k in sorted(os.environ):
        if k not in PER_JOB:
            print(f"env {k}={os.environ[k]}")
    print("agent store", os.environ.get("TORCHELASTIC_USE_AGENT_STORE"))
    print("argv", sys.argv)
    print("cwd", os.getcwd())
    m = os.umask(0); os.umask(m); print("umask", oct(m))
    for name in sorted(n for n in dir(resource) if n.startswith("RLIMIT_")):
        print("limit", name, resource.getrlimit(getattr(resource, name)))
    print("signals", [(int(s), str(signal.getsignal(s))) for s in signal.valid_signals()
                      if s not in (signal.SIGKILL, signal.SIGSTOP)])
    print("blocked", sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    print("fds", sorted(os.listdir("/proc/self/fd"))[:3], os.readlink("/proc/self/fd/0"))
    print("own group", os.getpgid(0) == os.getpid())
    print("path", [p for p in sys.path if "ptcluster-" not in p])
    print("main", sorted(k for k in vars(sys.modules["__main__"]) if k.startswith("__")))
    sys.stdout.flush()
    import time  # every rank has said all before any ends (the first end stops the job)
    mark = f"done-{os.environ['PTCLUSTER_JOB_ID']}-"
    open(mark + os.environ["RANK"], "w").close()
    while sum(n.startswith(mark) for n in os.listdir(".")) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)
    sys.exit(3)
""")


@pytest.fixture
def node(tmp_path: Path):
    """A project folder and cluster file (localhost, 2 slots, ``warm: IDLE``), this test's own
    runtime directory (its pools' folder: no other test's or user's pool is touched); after the
    test, ``warm stop`` and no process of it left."""
    runtime = Path(tempfile.mkdtemp(prefix="pw", dir="/tmp"))  # (short: sockets live in it)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    try:
        yield tmp_path, env
    finally:
        subprocess.run([sys.executable, "-m", "ptcluster", "warm", "stop"], cwd=tmp_path,
                       env={**os.environ, **env}, capture_output=True, timeout=60)
        left = left_behind(runtime, wait=15.0)
        shutil.rmtree(runtime, ignore_errors=True)
    assert not left, f"processes left behind: {left}"


def warm_run(idle: float = 60) -> list[str]:
    """``run`` on the local cluster, 2 ranks, warm with this idle timeout."""
    return ["run", "--nproc", "2", "--warm-idle", str(idle)]


def left_behind(runtime: Path, wait: float = 0.0) -> list[tuple[int, str]]:
    """Live processes started under this test's runtime directory (pools, their ranks, guards:
    the pool's environment carries it; a pooled rank's /proc environ is the pool's)."""
    needle = f"XDG_RUNTIME_DIR={runtime}".encode()
    deadline = time.monotonic() + wait
    while True:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{entry}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            except OSError:
                continue
            if needle in env and state != b"Z" and int(entry) != os.getpid():
                found.append((int(entry), cmd))
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def odd_process() -> None:
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    os.umask(0o077)
    soft, hard = resource.getrlimit(resource.RLIMIT_MSGQUEUE)  # (a limit the head keeps)
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (soft // 2, hard))


def pools(runtime_env: dict[str, str], cwd: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "ptcluster", "ps", "--json"], cwd=cwd,
                         env={**os.environ, **runtime_env}, capture_output=True, text=True,
                         timeout=60)
    return json.loads(out.stdout)["pools"]


def rank_lines(head: Head) -> list[str]:
    return sorted(line for line in head.lines if line.startswith("[localhost:"))


def test_a_warm_rank_sees_what_a_cold_one_sees(node) -> None:
    folder, env = node
    (folder / "show.py").write_text(SHOW)
    args = [*warm_run(), "show.py", "x", "--y=1"]
    # the pool is started by a run whose process differs (an ignored signal, a umask, a
    # limit): what a later run's ranks get is that run's, not the pool's
    odd = subprocess.run([sys.executable, "-m", "ptcluster", *args], cwd=folder,
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
                         preexec_fn=odd_process)
    said = [line.split("] ", 1) for line in odd.stdout.splitlines()
            if line.startswith("[localhost:")]  # ([node:rank, what it printed])
    assert odd.returncode == 1, odd.stderr
    assert sorted(who for who, what in said if what == "umask 0o77") == [
        "[localhost:0", "[localhost:1"], odd.stdout  # the run's umask, in both ranks
    assert "(14, '1')" in odd.stdout  # SIGALRM ignored, in both ranks
    cold_rc, cold = run_head(["run", "--nproc", "2", *args[5:]], folder, env=env)
    warm_rc, warm = run_head([*args[:5], "--run-dir", "runs-warm", *args[5:]], folder, env=env)
    _, summary = only_run(folder / "runs-warm")
    assert [a["warm"] for a in summary["attempts"]] == [{"localhost": True}], warm.err
    assert cold_rc == warm_rc == 1, (cold.err, warm.err)
    cold_lines, warm_lines = rank_lines(cold), rank_lines(warm)
    assert len(cold_lines) > 40 and any("env RANK=1" in line for line in cold_lines), cold.err
    differ = [(c, w) for c, w in zip(cold_lines, warm_lines, strict=True) if c != w]
    # what ARCHITECTURE.md says a warm rank can tell: no agent store serves it
    assert differ == [(f"[localhost:{r}] agent store True", f"[localhost:{r}] agent store False")
                      for r in (0, 1)]
    listed = pools(env, folder)
    assert [p["ranks"] for p in listed] == [0] and listed[0]["rss"] > 0


def test_an_edit_takes_effect_at_once_from_the_same_pool(node) -> None:
    folder, env = node
    script = folder / "train.py"
    args = [*warm_run(), "train.py"]
    script.write_text("import os\nprint('version 1', os.environ['RANK'])\n")
    rc, head = run_head(args, folder, env=env)
    assert rc == 0 and by_rank(head.lines)["localhost", 1] == ["version 1 1"], head.err
    first = [p["pid"] for p in pools(env, folder)]
    script.write_text("import os, sys\nprint('version 2', os.environ['RANK'])\nsys.exit(5)\n")
    rc, head = run_head(args, folder, env=env)
    assert rc == 1 and by_rank(head.lines)["localhost", 0] == ["version 2 0"], head.err
    assert [p["pid"] for p in pools(env, folder)] == first  # the same pool forked them


def test_the_pool_ends_after_its_idle_timeout(node) -> None:
    folder, env = node
    (folder / "hi.py").write_text("print('hi')\n")
    rc, head = run_head([*warm_run(8), "hi.py"], folder, env=env)
    assert rc == 0, head.err
    runtime = Path(env["XDG_RUNTIME_DIR"])
    assert left_behind(runtime), "no pool after a warm run"
    assert not left_behind(runtime, wait=20.0), "the pool outlived its idle timeout"
    assert pools(env, folder) == []
    assert [p.name for p in runtime.rglob("pool-*")] == []  # (its lock file too)


def test_warm_stop_ends_the_pool(node) -> None:
    folder, env = node
    (folder / "hi.py").write_text("print('hi')\n")
    rc, head = run_head([*warm_run(), "hi.py"], folder, env=env)
    assert rc == 0 and len(pools(env, folder)) == 1, head.err
    out = subprocess.run([sys.executable, "-m", "ptcluster", "warm", "stop", "--node",
                          "localhost"], cwd=folder, env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ended" in out.stdout, out
    assert not left_behind(Path(env["XDG_RUNTIME_DIR"]), wait=5.0)
    assert [p.name for p in Path(env["XDG_RUNTIME_DIR"]).rglob("pool-*")] == []


def test_without_warm_no_pool_starts(node) -> None:
    folder, env = node
    (folder / "hi.py").write_text("print('hi')\n")
    rc, head = run_head(["run", "--nproc", "2", "hi.py"], folder, env=env)
    assert rc == 0, head.err
    assert not left_behind(Path(env["XDG_RUNTIME_DIR"])) and pools(env, folder) == []


def test_a_pool_killed_under_its_ranks_is_named_and_leaves_nothing(node) -> None:
    folder, env = node
    (folder / "wait.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    head = Head([*warm_run(), "--run-dir", "runs", "wait.py"], folder, env=env)
    try:
        head.wait_for("] up", count=2)
        (pool,) = pools(env, folder)
        os.kill(pool["pid"], signal.SIGKILL)
        rc = head.wait(120)
    finally:
        if head.proc.poll() is None:
            head.kill()
    assert rc == 1
    _, summary = only_run(folder / "runs")
    cause = summary["root_cause"]
    assert (cause["code"], cause["fields"], cause["exit_code"]) == ("run.warm-pool-ended", {}, -9)
    assert cause["message"] in "\n".join(head.err) and cause["fix"], cause  # (said, with its fix)


def test_a_pool_killed_while_it_forks_the_first_rank_is_named_and_the_job_runs_cold(
        node) -> None:
    folder, env = node
    (folder / "hi.py").write_text("print('hi', flush=True)\n")
    args = [*warm_run(), "hi.py"]
    rc, head = run_head(args, folder, env=env)
    assert rc == 0, head.err
    (pool,) = pools(env, folder)
    os.kill(pool["pid"], signal.SIGSTOP)  # it takes the request, never answers
    head = Head([*args[:-1], "--run-dir", "runs", *args[-1:]], folder, env=env)
    try:
        # the guard has sent its fork request by now: the job starts in ~2 s, its guard's
        # hold (before its ready) waits 5 s for the stopped pool, then goes on unheld
        time.sleep(9.0)
        os.kill(pool["pid"], signal.SIGKILL)
        rc = head.wait(120)
    finally:
        if head.proc.poll() is None:
            head.kill()
    said = "\n".join(head.lines + head.err)
    assert rc == 0 and by_rank(head.lines)["localhost", 1] == ["hi"], said
    _, summary = only_run(folder / "runs")
    assert summary["attempts"][-1]["warm"] == {"localhost": False}, said  # its ranks cold


def test_another_user_is_refused(node) -> None:
    """The pool's folder is 0700 (another user cannot reach the socket); and with it opened,
    the pool still forks nothing for another uid (SO_PEERCRED)."""
    folder, env = node
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as nobody")
    (folder / "hi.py").write_text("print('hi')\n")
    rc, head = run_head([*warm_run(), "hi.py"], folder, env=env)
    assert rc == 0, head.err
    warm = Path(env["XDG_RUNTIME_DIR"]) / f"ptcluster-{os.getuid()}" / "warm"
    (sock,) = warm.glob("pool-*.sock")
    before = left_behind(Path(env["XDG_RUNTIME_DIR"]))
    code = textwrap.dedent(f"""
        import os, socket, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2] / "src")!r})
        from ptcluster.node.warm.protocol import FORK, receive, send
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(sys.argv[1])
        except OSError as exc:
            print("unreachable", exc.errno); sys.exit(0)
        try:
            send(s, {{"kind": FORK, "argv": ["-c", "x"], "env": {{}}, "cwd": "/"}}, [0, 1, 2])
            print("answer", receive(s)[0])
        except OSError as exc:  # (closed on us with our request unread: a reset)
            print("answer None", exc.errno)
    """)
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
              "-c", code, str(sock)]
    out = subprocess.run(nobody, capture_output=True, text=True, timeout=60, cwd="/")
    assert out.stdout.startswith("unreachable 13"), out  # EACCES: the folder is ours alone
    opened = (warm.parent.parent, warm.parent, warm)
    for path in opened:
        path.chmod(0o755)
    sock.chmod(0o777)
    try:
        out = subprocess.run(nobody, capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        for path in opened:
            path.chmod(0o700)
    assert out.stdout.startswith("answer None"), out  # closed without a fork
    assert sorted(left_behind(Path(env["XDG_RUNTIME_DIR"]))) == sorted(before)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (needs root)")
def test_a_pool_whose_record_cannot_be_written_is_not_started() -> None:
    """The node's disk full as a pool starts: it imports torch and listens, but cannot write
    the record that ``ps``, ``warm stop`` and prune read. A pool no one could list or stop is not
    kept: it says why on its ready line (its guard then starts the ranks cold, saying so) and
    ends, and leaves nothing in the folder: no socket, no record, no empty temp file."""
    import errno
    import threading

    from ptcluster.node import WARM_POOL
    from ptcluster.node.guard.warm_pool import WarmError, pool_process, ready
    from ptcluster.remote.bootstrap import pack_source

    full = Path(tempfile.mkdtemp(prefix="pf", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=700", "pf", str(full)],
                   check=True)
    sock = full / "pool-k.sock"
    try:
        with open(full / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass  # (the disk is full)
        # the pool program packed and started as a guard starts it, its ready line read so
        program = full.parent / f"{full.name}-pool.py"
        program.write_text(pack_source(WARM_POOL))
        try:
            ready(pool_process(sys.executable, str(sock), 30.0, 0, [], dict(os.environ),
                               str(program)), threading.Event())
            said = ""
        except WarmError as exc:
            said = str(exc)
        finally:
            program.unlink()
        deadline = time.monotonic() + 10
        while (left := _with_arg(str(sock))) and time.monotonic() < deadline:
            time.sleep(0.1)
        files = sorted(p.name for p in full.iterdir())
    finally:
        for pid in _with_arg(str(sock)):
            os.kill(pid, signal.SIGKILL)  # (this test's own leftover, whatever happened above)
        subprocess.run(["umount", "--lazy", str(full)], check=False)  # (one ending may hold it)
        full.rmdir()
    assert os.strerror(errno.ENOSPC) in said and str(full) in said, said
    assert not left, f"the pool still runs: {left}"
    assert files == ["filler"], files


def _with_arg(arg: str) -> list[int]:
    """The processes with ``arg`` among their command line's words."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if arg.encode() in argv:
                out.append(int(entry))
    return out


def test_a_pool_still_importing_when_its_guard_must_say_ready_goes_on_for_the_next_run(
        tmp_path) -> None:
    """``run --warm``'s guard waits for a new pool only so long before its ``ready`` (the
    head's ready timeout): a pool whose imports take longer is left to start (this run cold)
    and then serves: its socket answers, its ready line gone nowhere (its guard's pipe closed).
    While it imports it holds its key's lock (inherited from its guard): no second pool of the
    key starts meanwhile; once it listens, the lock is free."""
    import threading

    from ptcluster.node import WARM_POOL
    from ptcluster.node.guard.warm_pool import WarmError, hold, pool_process, ready
    from ptcluster.node.warm.protocol import hold_key
    from ptcluster.remote.bootstrap import pack_source

    (tmp_path / "slow_import_mod.py").write_text("import time\ntime.sleep(4)\n")
    sock = Path(tempfile.mkdtemp(prefix="ps", dir="/tmp")) / "pool-k.sock"
    lock_path = str(sock.parent / "pool-k.lock")
    program = tmp_path / "pool.py"
    program.write_text(pack_source(WARM_POOL))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    lock = hold_key(lock_path, 1.0)
    try:
        with pytest.raises(WarmError, match="still importing after 1 s"):
            ready(pool_process(sys.executable, str(sock), 30.0, 0, ["slow_import_mod"], env,
                               str(program), lock), threading.Event(), within=1.0)
        os.close(lock)
        with pytest.raises(BlockingIOError):  # (the pool holds it while it imports)
            os.close(hold_key(lock_path, 0.3))
        log = sock.parent / "pool-k.log"  # (made once the ready line is behind it: it serves)
        deadline = time.monotonic() + 30
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        live, held = hold(str(sock))
        if held is not None:
            held.close()
        assert log.exists() and live, "the pool did not go on after its guard stopped waiting"
        os.close(hold_key(lock_path, 5.0))  # (free once it listens)
    finally:
        for pid in _with_arg(str(sock)):
            os.kill(pid, signal.SIGKILL)  # (the pool this test started)
        shutil.rmtree(sock.parent, ignore_errors=True)


def test_a_pool_its_guards_hold_outlives_its_idle_timeout_and_forks_after(tmp_path) -> None:
    """A user's pool held by a guard between its ``ready`` and its ``go`` (a slow node
    elsewhere) never ends by its idle timeout meanwhile, as the guard that started it holds it
    (from its start: a socket pair) and as one that found it holds it (``hold``); once let go,
    it ends after its idle seconds. The pool started and asked as a guard does, real forks."""
    import socket
    import threading

    from ptcluster.node import SHIM, WARM_POOL
    from ptcluster.node.guard.warm_pool import hold, pool_process, ready
    from ptcluster.node.rank_wire import CHILD_FLAG, SHIM_VAR
    from ptcluster.node.warm.protocol import FORK, PID, STATUS, receive, send
    from ptcluster.remote.bootstrap import pack_source

    folder = Path(tempfile.mkdtemp(prefix="ph", dir="/tmp"))
    sock = folder / "pool-k.sock"
    (tmp_path / "pool.py").write_text(pack_source(WARM_POOL))
    (tmp_path / "shim.py").write_text(pack_source(SHIM))
    (tmp_path / "hi.py").write_text("print('forked', flush=True)\n")
    idle = 1.0

    def fork() -> tuple[dict | None, str]:
        """hi.py run as a rank the pool forks: its status, its output."""
        out_r, out_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(60)
        try:
            conn.connect(str(sock))
            send(conn, {"kind": FORK, "argv": ["-c", CHILD_FLAG, "hi.py"], "cwd": str(tmp_path),
                        "env": {"PATH": os.environ["PATH"], SHIM_VAR: str(tmp_path / "shim.py")}},
                 [null, out_w, out_w])
            os.close(out_w)
            said, fds = receive(conn)
            for fd in fds:
                os.close(fd)
            status = receive(conn)[0] if said and said["kind"] == PID else said
            with os.fdopen(out_r) as f:
                return status, f.read()
        finally:
            conn.close()
            os.close(null)

    mine, its = socket.socketpair()
    try:
        proc = pool_process(sys.executable, str(sock), idle, 0, [], dict(os.environ),
                            str(tmp_path / "pool.py"), held=its.fileno())
        its.close()
        proc.wait()  # (its first process: the pool goes on out of our tree)
        ready(proc, threading.Event())
        time.sleep(3 * idle + 1)  # (held by the guard that started it, well past its idle)
        assert fork() == ({"kind": STATUS, "code": 0}, "forked\n")
        mine.close()  # (ranks forked: the starting guard lets it go)
        live, held = hold(str(sock))  # (the next run's guard, before its ready)
        assert live and held is not None
        time.sleep(3 * idle + 1)
        assert fork() == ({"kind": STATUS, "code": 0}, "forked\n")
        assert _with_arg(str(sock)), "the pool ended while a guard held it"
        held.close()
        deadline = time.monotonic() + 15  # (let go: its idle clock runs again)
        while _with_arg(str(sock)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _with_arg(str(sock)), "the pool outlived its idle timeout once let go"
    finally:
        mine.close()
        for pid in _with_arg(str(sock)):
            os.kill(pid, signal.SIGKILL)  # (the pool this test started)
        shutil.rmtree(folder, ignore_errors=True)
