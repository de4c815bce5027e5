"""A node other users share: what they can plant where ptcluster's node programs open files
(``/tmp``, the lease directory) neither blocks, deletes, steers nor crashes them.

Real users (the attacker is ``nobody``, uid 65534, via ``setpriv``; the victim is this test's
root), real FIFOs, real symlinks, the real guard started by the real channel. Needs root and
setpriv (skipped without). Each test works in directories of its own (``TMPDIR`` and the lease
directory pointed there), never in this machine's ``/tmp`` or ``/run/lock``; but one, which
leases a fresh resource in the real ``/run/lock`` (as nobody and as root) and leaves nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ptcluster
from ptcluster.node import kill, sampler
from ptcluster.node.sharing import leases

SRC = Path(ptcluster.__file__).resolve().parents[1]
"""The ptcluster under test (the processes started here import it too)."""
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3"]
OWNER = {"job_id": "J7", "head": "laptop", "command": "python train.py", "ranks": [0, 1]}

pytestmark = pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv (a second real user)")


def as_nobody(code: str, *args: str, wait: bool = True, timeout: float = 30
              ) -> subprocess.Popen[str] | subprocess.CompletedProcess[str]:
    """``python3 -c code ARGS`` as uid 65534 (this checkout's src on its path)."""
    argv = [*NOBODY, "-c", code, *args]
    env = {"PYTHONPATH": str(SRC), "HOME": "/nonexistent"}
    if not wait:
        return subprocess.Popen(argv, cwd="/", env=env, stdout=subprocess.PIPE, text=True)
    return subprocess.run(argv, cwd="/", env=env, capture_output=True, text=True,
                          timeout=timeout)


def shared_dir(prefix: str) -> Path:
    """A directory like /tmp or /run/lock: root's, mode 1777."""
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix=prefix))
    os.chmod(d, 0o1777)
    return d


@pytest.fixture
def lease_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = shared_dir("ptc-sharing-leases-")
    monkeypatch.setattr(leases, "LEASE_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def victim_home(root: Path) -> Path:
    home = root / "home"
    (home / "sub").mkdir(parents=True)
    (home / "important.txt").write_text("keep me\n")
    (home / "sub" / "data.bin").write_bytes(b"\0" * 100)
    return home


def guard_first_frame(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tmpdir: Path,
                      wait: float = 20.0, runtime: Path | None = None) -> str:
    """Start the real guard on this machine (the local channel) with ``TMPDIR=tmpdir``; its
    first ``ready``/``error`` line, or "" when none came within ``wait`` s (it is blocked)."""
    from ptcluster.cluster import local_cluster
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.plan import Target, new_job_id, plan_launch
    from ptcluster.node import GUARD
    from ptcluster.remote.channel import NodeChannel, close_all, start_all
    from ptcluster.remote.transport import LocalTransport

    (tmp_path / "t.py").write_text("")
    plan = plan_launch(local_cluster(1), Target(script=str(tmp_path / "t.py")), port=0,
                       job_id=new_job_id())
    cfg = plan.nodes[0].guard_config(plan, RunOptions())
    seen: list[str] = []
    came = threading.Event()

    def frames(lines: list[str]) -> None:
        for line in lines:
            if line.startswith(("ready ", "error ")):
                seen.append(line)
                came.set()

    monkeypatch.setenv("TMPDIR", str(tmpdir))
    if runtime is None:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    else:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    channel = NodeChannel(LocalTransport(host="localhost"), sys.executable, GUARD, cfg,
                          on_frames=frames, on_closed=lambda code, err: None)
    started = start_all([channel], lambda c, said: None)
    try:
        came.wait(wait)
    finally:
        close_all(started, timeout=10)
    return seen[0] if seen else ""


PLANT_AND_SWAP = textwrap.dedent("""
    import os, sys, time
    base, victim, stop = sys.argv[1:4]
    trap = os.path.join(base, "ptcluster-x")
    os.mkdir(trap, 0o755)
    os.mkfifo(os.path.join(trap, "guard.pid"), 0o644)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not os.path.exists(stop):
        try:  # ENXIO until a reader has the FIFO open: then we know it waits in its read
            fd = os.open(os.path.join(trap, "guard.pid"), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            time.sleep(0.01)
            continue
        os.rename(trap, trap + "-gone")  # the folder it opened the pid file in ...
        os.symlink(victim, trap)         # ... is now a link to the victim's files
        os.write(fd, open("/proc/sys/kernel/pid_max").read().strip().encode())  # a dead pid
        os.close(fd)
        print("a reader opened the FIFO, swapped", flush=True)
        break
    else:
        print("no reader", flush=True)
""")


@pytest.mark.no_job  # (the guard is never told to go)
def test_a_guard_start_neither_waits_on_nor_deletes_through_what_another_user_planted_in_tmp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nobody plants ``$TMPDIR/ptcluster-x/`` with a FIFO ``guard.pid``: the moment a guard
    opens it (the FIFO tells), the folder becomes a link to the victim's files and a dead pid
    is written. A guard that cleaned every ``ptcluster-*`` entry would empty them (as root:
    any files); ours reaches ``ready`` without ever opening it, and everything is there."""
    base = shared_dir("ptc-sharing-tmp-")
    home = victim_home(tmp_path)
    stop = base / "stop"
    attacker = as_nobody(PLANT_AND_SWAP, str(base), str(home), str(stop), wait=False)
    try:
        deadline = time.monotonic() + 20
        while not (base / "ptcluster-x" / "guard.pid").exists():
            assert time.monotonic() < deadline and attacker.poll() is None
            time.sleep(0.05)
        first = guard_first_frame(tmp_path, monkeypatch, base)
        stop.touch()
        out, _ = attacker.communicate(timeout=30)
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        shutil.rmtree(base, ignore_errors=True)
    left = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    assert left == ["important.txt", "sub", "sub/data.bin"], (left, out)
    assert out.strip() == "no reader", out
    assert first.startswith("ready "), first


@pytest.mark.no_job
def test_a_users_temp_parent_planted_by_another_user_is_refused_in_one_line_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nobody makes the victim's own parent first (``$TMPDIR/ptcluster-0``, theirs, open to
    all), with a FIFO ``guard.pid`` and a link to the victim's files in it: the guard refuses
    at once, naming the directory and its owner; nothing is opened, waited on or removed."""
    base = shared_dir("ptc-sharing-tmp-")
    home = victim_home(tmp_path)
    plant = ("import os, sys; d = os.path.join(sys.argv[1], 'ptcluster-%d' % int(sys.argv[3]));"
             " os.mkdir(d, 0o777); os.chmod(d, 0o777); os.mkfifo(os.path.join(d, 'guard.pid'));"
             " os.mkdir(os.path.join(d, 'J-1')); os.mkfifo(os.path.join(d, 'J-1', 'guard.pid'));"
             " os.symlink(sys.argv[2], os.path.join(d, 'J-2'))")
    try:
        made = as_nobody(plant, str(base), str(home), str(os.getuid()))
        assert isinstance(made, subprocess.CompletedProcess) and made.returncode == 0, made
        started = time.monotonic()
        first = guard_first_frame(tmp_path, monkeypatch, base)
        took = time.monotonic() - started
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert first.startswith("error "), first
    said = json.loads(first.split(" ", 1)[1])
    assert f"ptcluster-{os.getuid()} belongs to uid 65534" in said["problem"], said
    assert said["code"] == "guard.tmp-unusable" and not said.get("busy"), said
    assert took < 15, took
    assert sorted(p.name for p in home.rglob("*")) == ["data.bin", "important.txt", "sub"]


@pytest.mark.no_job
def test_a_users_runtime_dir_is_used_where_it_exists_so_a_planted_tmp_parent_does_not_refuse(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``$XDG_RUNTIME_DIR`` a directory of ours closed to others (``/run/user/UID``), the
    guard's parent is made there: what another user planted at ``$TMPDIR/ptcluster-UID``
    refuses nothing (L9). One open to others is not used."""
    base = shared_dir("ptc-sharing-tmp-")
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    try:
        made = as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o777)",
                         str(base / f"ptcluster-{os.getuid()}"))
        assert isinstance(made, subprocess.CompletedProcess) and made.returncode == 0, made
        first = guard_first_frame(tmp_path, monkeypatch, base, runtime=runtime)
        assert first.startswith("ready "), first
        assert (runtime / f"ptcluster-{os.getuid()}").is_dir()
        runtime.chmod(0o755)
        first = guard_first_frame(tmp_path, monkeypatch, base, runtime=runtime)
        assert first.startswith("error "), first
        said = json.loads(first.split(" ", 1)[1])
        # (a runtime dir open to others is passed over: TMPDIR's, nobody's, is refused)
        assert said["code"] == "guard.tmp-unusable", said
        assert said["fields"]["path"] == str(base / f"ptcluster-{os.getuid()}"), said
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_cleanup_removes_only_its_own_dead_guards_dirs_and_never_waits(tmp_path) -> None:
    """In the user's own parent: a dead guard's directory goes (a link inside it is removed,
    not followed); a live guard's stays; a FIFO pid file is skipped at once."""
    from ptcluster.node.guard import tmpdirs

    home = victim_home(tmp_path)
    parent = tmp_path / "ptcluster-0"
    parent.mkdir(mode=0o700)
    dead = parent / "dead"
    dead.mkdir()
    (dead / "guard.pid").write_text(Path("/proc/sys/kernel/pid_max").read_text())
    (dead / "home").symlink_to(home)
    live = Path(tmpdirs.job_dir(str(parent), "live", {"shim.py": "pass\n"}))
    assert oct(live.stat().st_mode & 0o777) == "0o700"
    assert (live / "guard.pid").read_text() == str(os.getpid())
    fifo = parent / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "guard.pid")
    started = time.monotonic()
    tmpdirs.remove_stale(str(parent))
    assert time.monotonic() - started < 5
    assert sorted(p.name for p in parent.iterdir()) == ["fifo", live.name]
    assert sorted(p.name for p in home.rglob("*")) == ["data.bin", "important.txt", "sub"]


# -- the lease directory ------------------------------------------------------------------------
HOLD = ("import sys, time; from ptcluster.node.sharing import leases; "
        "leases.LEASE_DIR = sys.argv[1]; "
        "held = leases.take(sys.argv[2], {'job_id': 'J7', 'ranks': [0, 1]}); "
        "print('held' if held else 'busy', flush=True); time.sleep(60)")


@pytest.fixture
def guard_of_j7(lease_dir: Path) -> Iterator[subprocess.Popen[str]]:
    """A process of ours that holds job J7's lease, with a guard's last words (``guard J7``)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lease_dir), "job-J7", "guard", "J7"],
                            env={**os.environ, "PYTHONPATH": str(SRC)}, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


FORGE = textwrap.dedent("""
    import json, os, sys
    d, name = sys.argv[1], sys.argv[2]
    for tag, record in json.loads(sys.argv[3]).items():
        path = os.path.join(d, f"{name}.{tag}.json")
        with open(path, "w") as f:
            f.write(record if isinstance(record, str) else json.dumps(record))
        os.chmod(path, 0o644)
""")


def forge(lease_dir: Path, name: str, records: dict[str, object]) -> None:
    """nobody writes ``NAME.TAG.json`` files (a str: written as is) into the lease dir."""
    done = as_nobody(FORGE, str(lease_dir), name, json.dumps(records))
    assert isinstance(done, subprocess.CompletedProcess) and done.returncode == 0, done


def test_a_forged_record_does_not_redirect_kill(lease_dir, guard_of_j7) -> None:
    """nobody writes ``job-J7@HOST.zzz.json`` naming another process of the victim's (uid 0,
    the newest ``since``): the victim's ``kill`` signals J7's guard, never that process."""
    here = socket.gethostname()
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        forge(lease_dir, leases.lease_name("job-J7"), {"zzz": {
            "job_id": "J7", "resource": "job-J7", "node": here, "pid": bystander.pid,
            "uid": 0, "user": "root", "since": 4e9, "command": "python x.py"}})
        held = leases.held_all()
        assert [(r["pid"], r["user"]) for r in held] == [(guard_of_j7.pid, "root")], held
        said = kill.end_job("J7", "TERM", {"host": "h", "user": "root"})
        assert said["signalled"] and said["pid"] == guard_of_j7.pid, said
        assert guard_of_j7.wait(timeout=10) == -signal.SIGTERM
        time.sleep(0.2)
        assert bystander.poll() is None  # untouched
    finally:
        bystander.kill()
        bystander.wait()


def test_kill_signals_only_a_guard_of_that_job_of_that_user(lease_dir) -> None:
    """A process that holds J7's lease but is not a guard of J7 (its command line says
    otherwise): not signalled."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lease_dir), "job-J7", "other"],
                            env={**os.environ, "PYTHONPATH": str(SRC)}, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert kill.end_job("J7", "TERM", {"host": "h", "user": "root"}) == {"found": False}
        assert proc.poll() is None
        assert not list(lease_dir.glob("ptcluster-kill-*"))
    finally:
        proc.kill()
        proc.wait()


def test_malformed_records_are_skipped_by_every_reader(lease_dir, guard_of_j7) -> None:
    """nobody's records beside a held lease: text for ``since``, a pid past any pid, a list,
    ranks that are not numbers, half a JSON text; ps's and the monitor's reader, the busy
    refusal's and kill's all go on with the one true record."""
    here = socket.gethostname()
    base = {"job_id": "J7", "resource": "job-J7", "node": here, "uid": 65534,
            "pid": guard_of_j7.pid, "since": 1.0}
    forge(lease_dir, leases.lease_name("job-J7"), {
        "65534": {**base, "since": "soon"}, "a": {**base, "pid": 2 ** 70}, "b": [1, 2],
        "c": {**base, "ranks": ["x", "y"]}, "d": '{"pid": ', "e": {**base, "since": 1e300},
        "f": {**base, "since": 4e9}})  # (well formed, but the process is not nobody's)
    held = leases.held_all()
    assert [r["pid"] for r in held] == [guard_of_j7.pid], held
    assert sampler.jobs(held)["J7"]["ranks"] == 2
    who = leases.holder("job-J7")
    assert who is not None and who["pid"] == guard_of_j7.pid
    assert (who["job_id"], who["user"]) == ("J7", "root")  # the true record's
    assert leases.describe({**base, "since": "soon"}).startswith("job J7 (")
    said = kill.end_job("J7", "TERM", {"host": "h", "user": "root"})
    assert said["signalled"], said


def test_fifos_and_links_in_the_lease_directory_never_block(lease_dir, guard_of_j7) -> None:
    """nobody plants FIFOs where a lock, a record and a kill note go, and a link to
    /dev/zero: taking a lease, listing them, reading kill's notes return at once."""
    here = socket.gethostname()
    plant = ("import os, sys; d, h = sys.argv[1], sys.argv[2];"
             " os.mkfifo(os.path.join(d, f'ptcluster-port-29500@{h}.lock'), 0o666);"
             " os.mkfifo(os.path.join(d, f'ptcluster-job-J7@{h}.65534.json'), 0o666);"
             " os.mkfifo(os.path.join(d, f'ptcluster-kill-J7@{h}.0.json'), 0o666);"
             " os.symlink('/dev/zero', os.path.join(d, f'ptcluster-gpu-3@{h}.lock'))")
    made = as_nobody(plant, str(lease_dir), here)
    assert isinstance(made, subprocess.CompletedProcess) and made.returncode == 0, made
    probe = textwrap.dedent("""
        import json, sys
        from ptcluster.node.sharing import leases
        leases.LEASE_DIR = sys.argv[1]
        out = {"held": [r["pid"] for r in leases.held_all()],
               "notes": leases.read_kill_notes("J7")}
        for resource in ("port-29500", "gpu-3"):
            try:
                out[resource] = repr(leases.take(resource, {}))
            except OSError as exc:
                out[resource] = str(exc)
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", probe, str(lease_dir)], capture_output=True,
                          text=True, timeout=20, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["held"] == [guard_of_j7.pid] and out["notes"] == {}, out
    assert out["port-29500"] == "None" and out["gpu-3"] == "None", out  # busy (M1: below)


PLANT_LOCKS = textwrap.dedent("""
    import os, sys
    d, h = sys.argv[1], sys.argv[2]
    at = lambda r: os.path.join(d, f'ptcluster-{r}@{h}.lock')
    os.mkdir(at('gpu-0'), 0o777)
    os.symlink('/etc/passwd', at('gpu-1'))
    os.mkfifo(at('gpu-2'), 0o666)
    os.close(os.open(at('gpu-3'), os.O_CREAT | os.O_WRONLY, 0o000))
    os.mkdir(at('port-29500'), 0o777)
""")
TAKE_PAST_THEM = textwrap.dedent("""
    import json, sys
    from ptcluster.node.sharing import leases
    from ptcluster.node.guard import gpus
    from ptcluster.node.guard.prechecks import lease_master_port
    leases.LEASE_DIR = sys.argv[1]
    gpus.gpus = lambda: {"count": 6}  # (this machine has none; the leasing is the real one)
    gpus.compute_processes = lambda: ({}, None)
    out = {}
    for r in ("gpu-0", "gpu-1", "gpu-2", "gpu-3"):
        got = leases.take(r, {})
        out[r] = repr(got)
        if got is not None:
            got.release()
    chosen, held = gpus.claim("auto", 2, {"job_id": "J9"}, {})
    out["gpus"], out["why"] = chosen["indices"], chosen["why"]
    port, lease = lease_master_port("auto", {"job_id": "J9"})
    out["port"] = port
    try:
        gpus.claim([0], 1, {"job_id": "J9"}, {})
    except Exception as exc:
        out["gpu-0 asked"] = [type(exc).__name__, getattr(exc, "busy", None)]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("victim", [4242, 0])
def test_a_planted_dir_link_fifo_or_mode_000_lock_is_busy_and_passed_over(lease_dir,
                                                                          victim: int) -> None:
    """M1: nobody plants a directory, a symlink, a FIFO and a mode-000 file where the locks of
    gpu-0..3 go, and a directory at the first auto port's. For another user (uid 4242) and for
    root each is a lease held by an unknown holder: the GPU and the port are passed over, a
    GPU asked for by number is busy (``--wait`` waits), never a refusal of the job. On e44ddf7
    ``take`` raised (EISDIR, ELOOP, "not a regular file", EACCES) and every GPU job there was
    refused."""
    made = as_nobody(PLANT_LOCKS, str(lease_dir), socket.gethostname())
    assert isinstance(made, subprocess.CompletedProcess) and made.returncode == 0, made
    argv = ["setpriv", f"--reuid={victim}", f"--regid={victim}", "--clear-groups",
            sys.executable, "-c", TAKE_PAST_THEM, str(lease_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    planted = ["gpu-0", "gpu-1", "gpu-2"] + (["gpu-3"] if victim else [])
    assert all(out[r] == "None" for r in planted), out
    # root may open a mode-000 file (for root, gpu-3 is a leftover lock it takes), and root's
    # Leasing sweeps the link and the FIFO away; a directory it cannot remove stays busy
    assert out["gpus"] == ([4, 5] if victim else [1, 2]), out
    assert out["port"] == 29501 and out["gpu-0 asked"] == ["GuardError", True], out


def test_another_users_leftover_lock_never_refuses_a_lease(lease_dir) -> None:
    """nobody's guard died holding ``gpu-0``: its lock file stays (0444, nobody's). Under
    ``fs.protected_regular=2`` (Ubuntu's default; set here for the test and put back) an
    ``O_CREAT`` of that file fails for every other user, root too: the lease is taken from
    the file as it is (read-only, locked), never refused."""
    name = leases.lease_name("gpu-0")
    made = as_nobody("import os, sys; os.close(os.open(sys.argv[1], os.O_CREAT | os.O_RDONLY, "
                     "0o444))", str(lease_dir / f"{name}.lock"))
    assert isinstance(made, subprocess.CompletedProcess) and made.returncode == 0, made
    knob = Path("/proc/sys/fs/protected_regular")
    before = knob.read_text().strip() if knob.exists() else None
    try:
        try:
            knob.write_text("2")
        except OSError:
            pytest.skip("fs.protected_regular cannot be set here")
        lease = leases.take("gpu-0", OWNER)
    finally:
        if before is not None:
            knob.write_text(before)
    assert lease is not None
    assert leases.holder("gpu-0")["pid"] == os.getpid()
    lease.release()
    assert leases.holder("gpu-0") is None


def test_a_user_cannot_make_the_lease_directory_and_root_makes_it_roots(tmp_path) -> None:
    """Missing lease directory: nobody's leasing refuses (it would be nobody's, trusted by
    every later job); root's guard makes it, root's, 1777."""
    parent = shared_dir("ptc-sharing-run-")
    try:
        code = ("import sys; from ptcluster.node.sharing import leases\n"
                "leases.LEASE_DIR = sys.argv[1]\n"
                "try:\n    leases.Leasing()\nexcept OSError as exc:\n    print('refused', exc)\n"
                "else:\n    print('leased')")
        said = as_nobody(code, str(parent / "ptcluster"))
        assert isinstance(said, subprocess.CompletedProcess), said
        assert said.stdout.startswith("refused ") and "is missing" in said.stdout, said
        assert not (parent / "ptcluster").exists()
        leases.Leasing(str(parent / "ptcluster"))
        st = os.lstat(parent / "ptcluster")
        assert st.st_uid == 0 and oct(st.st_mode & 0o7777) == "0o1777"
    finally:
        shutil.rmtree(parent, ignore_errors=True)


TAKE = textwrap.dedent("""
    import json, sys
    from ptcluster.node.guard.prechecks import job_leasing
    from ptcluster.node.guard.refusal import GuardError
    try:
        lease = job_leasing({}).take(sys.argv[1], {"job_id": "J8", "command": "python t.py"})
    except GuardError as exc:
        print(json.dumps({"refused": exc.problem}), flush=True)
        sys.exit(0)
    print(json.dumps({"lock": lease and lease.lock_path}), flush=True)
    sys.stdin.read()
    if lease:
        lease.release()
""")


def test_a_user_leases_in_the_real_run_lock_where_setup_never_ran_the_same_file_as_root() -> None:
    """nobody's guard, on a machine where ``ptcluster setup`` never ran, leases in the system's
    /run/lock (root's, sticky, 1777 from boot): no directory of ptcluster's is needed. Root's
    guard leases the same file, so neither takes what the other holds. A fresh resource; its
    files are gone at the end (each holder removes its own)."""
    from ptcluster.launch.plan import new_job_id

    st = os.lstat("/run/lock")
    if st.st_uid != 0 or st.st_mode & 0o7777 != 0o1777:
        pytest.skip(f"/run/lock here is not root's 1777 directory ({st.st_mode:o})")
    resource = f"test-{new_job_id()}"
    lock = f"/run/lock/ptcluster-{resource}@{socket.gethostname()}.lock"
    holder = subprocess.Popen([*NOBODY, "-c", TAKE, resource], cwd="/", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={"PYTHONPATH": str(SRC), "HOME": "/nonexistent"})
    assert holder.stdout is not None
    try:
        said = json.loads(holder.stdout.readline() or "{}")
        assert said == {"lock": lock}, said
        assert os.lstat(lock).st_uid == 65534
        assert leases.take(resource, OWNER) is None  # root's guard: the same lease, held
        who = leases.holder(resource)
        assert who is not None and (who["uid"], who["job_id"]) == (65534, "J8"), who
    finally:
        holder.kill()  # (SIGKILL: its files stay, for root's sweep)
        holder.wait()
    mine = leases.Leasing().take(resource, OWNER)
    try:
        assert mine is not None and mine.lock_path == lock
        busy = as_nobody(TAKE, resource)
        assert isinstance(busy, subprocess.CompletedProcess), busy
        assert json.loads(busy.stdout) == {"lock": None}, busy  # root holds it: nobody waits
    finally:
        if mine:
            mine.release()
        for left in Path("/run/lock").glob(f"ptcluster-{resource}@*"):
            left.unlink()
    assert not list(Path("/run/lock").glob(f"ptcluster-{resource}@*"))
