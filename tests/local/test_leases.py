"""Leases on a node's resources (node/sharing/leases.py) and the master's rendezvous port
(node.guard.prechecks.lease_master_port): real flocks in a private directory, real processes, real
sockets. The jobs that use them are in tests/testbed/test_run.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ptcluster.monitor.jobs import job_rows
from ptcluster.node import sampler
from ptcluster.node.guard import gpus
from ptcluster.node.guard.prechecks import lease_master_port
from ptcluster.node.guard.refusal import UNLEASED_FIX, GuardError
from ptcluster.node.sharing import leases
from ptcluster.node.sharing.records import sampled
from ptcluster.remote.guard_replies import GPUS


@pytest.fixture
def lease_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "run" / "lock"  # (made by the first Leasing, as root: as a root guard would)
    d.parent.mkdir()
    monkeypatch.setattr(leases, "LEASE_DIR", str(d))
    return d


OWNER = {"job_id": "20261201-0930-ab12", "head": "laptop", "command": "python train.py"}


def test_a_lease_is_exclusive_says_who_and_is_released(lease_dir) -> None:
    first = leases.take("port-29500", OWNER)
    assert first is not None
    assert oct(lease_dir.stat().st_mode & 0o7777) == "0o1777"  # sticky, anyone may lease
    assert leases.take("port-29500", OWNER) is None  # another open file: refused
    who = leases.holder("port-29500")
    assert who is not None and who["job_id"] == OWNER["job_id"] and who["pid"] == os.getpid()
    since = time.strftime("%H:%M", time.localtime(who["since"]))
    assert leases.describe(who) == f"job 20261201-0930-ab12 ({who['user']}, python train.py, " \
        f"since {since}, head laptop)"  # (the rendering every refusal of a held thing says)
    info = Path(first.info_path)
    assert oct(info.stat().st_mode & 0o777) == "0o644"  # world-readable: never a secret
    assert json.loads(info.read_text())["resource"] == "port-29500"
    assert leases.holder("port-29501") is None
    first.release()
    assert leases.holder("port-29500") is None and not info.exists()
    again = leases.take("port-29500", OWNER)
    assert again is not None
    again.release()


def holder_process(lease_dir: Path, resource: str) -> subprocess.Popen[str]:
    """A real process that holds ``resource`` until it is killed (it says when it does)."""
    code = ("import sys, time; sys.path[:0] = sys.argv[3:]; "
            "from ptcluster.node.sharing import leases; "
            "leases.LEASE_DIR = sys.argv[1]; held = leases.take(sys.argv[2], {}); "
            "print('held', flush=True); time.sleep(60)")
    return subprocess.Popen([sys.executable, "-c", code, str(lease_dir), resource, *sys.path],
                            stdout=subprocess.PIPE, text=True)


def test_the_kernel_releases_a_lease_when_its_holder_is_killed(lease_dir) -> None:
    proc = holder_process(lease_dir, "gpu-0")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert leases.take("gpu-0", OWNER) is None
        assert leases.holder("gpu-0")["pid"] == proc.pid
        proc.send_signal(signal.SIGKILL)  # no cleanup of any kind
        proc.wait(timeout=10)
        lease = leases.take("gpu-0", OWNER)
        assert lease is not None  # free at once: the lock went with the process
        lease.release()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_planted_symlinks_are_never_followed(lease_dir, tmp_path) -> None:
    leases.ensure_dir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    name = leases.lease_name("port-29500")
    (lease_dir / (name + ".lock")).symlink_to(victim)
    # O_NOFOLLOW: ELOOP, not the victim's lock; the lease is busy (an unknown holder's: M1)
    assert leases.take("port-29500", OWNER) is None
    (lease_dir / (name + ".lock")).unlink()
    (lease_dir / f"{name}.{os.getuid()}.json").symlink_to(victim)  # the holder's file
    lease = leases.take("port-29500", OWNER)
    assert lease is not None
    assert victim.read_text() == "precious"  # replaced the link, wrote nothing through it
    assert not Path(lease.info_path).is_symlink()
    lease.release()


def test_a_fixed_port_held_by_another_job_is_refused_naming_it(lease_dir) -> None:
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    first_port, lease = lease_master_port(port, OWNER)
    assert first_port == port
    try:
        with pytest.raises(GuardError) as info:
            lease_master_port(port, {**OWNER, "job_id": "second"})
        assert (info.value.code, info.value.fields["port"]) == ("guard.port-leased", str(port))
        assert info.value.fields["holder"] == leases.describe(leases.holder(f"port-{port}"))
        assert info.value.busy and info.value.fix
    finally:
        lease.release()


def test_auto_takes_the_first_port_neither_leased_nor_bound(lease_dir) -> None:
    start = leases.take("port-29500", OWNER)  # another job's lease (whatever its socket)
    bound = socket.socket()
    bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        bound.bind(("", 29501))  # and something else's socket
    except OSError:
        pytest.skip("port 29501 is in use here")
    bound.listen()
    try:
        port, lease = lease_master_port("auto", OWNER)
        try:
            assert port >= 29502
            assert leases.holder(f"port-{port}")["job_id"] == OWNER["job_id"]
            assert leases.holder("port-29501") is None  # skipped, not left leased
            second, other = lease_master_port("auto", OWNER)  # a second job: the next one
            assert second > port
            other.release()
        finally:
            lease.release()
    finally:
        bound.close()
        assert start is not None
        start.release()


def test_a_lease_directory_that_is_not_roots_sticky_one_is_refused(lease_dir) -> None:
    """Only root's 1777 directory is trusted: another user's (its owner could unlink or take
    every lease in it), one without the sticky bit, a link or a file in its place."""
    lease_dir.mkdir(mode=0o1777)
    os.chmod(lease_dir, 0o1777)
    os.chown(lease_dir, 65534, 65534)  # a user's directory, sticky and open to all
    with pytest.raises(OSError, match="belongs to uid 65534, not to root"):
        leases.take("port-29500", OWNER)
    os.chown(lease_dir, 0, 0)
    os.chmod(lease_dir, 0o777)
    with pytest.raises(OSError, match="has mode 777, not 1777"):
        leases.take("port-29500", OWNER)
    lease_dir.rmdir()
    good = lease_dir.parent / "elsewhere"
    good.mkdir(mode=0o1777)
    os.chmod(good, 0o1777)
    lease_dir.symlink_to(good)
    with pytest.raises(OSError, match="is not a directory"):
        leases.Leasing()
    assert os.listdir(good) == []


def test_gpus_auto_takes_free_ones_and_explicit_gpus_held_are_refused_naming_the_job(
        lease_dir) -> None:
    """On this machine (no GPU: NVML's part is skipped, and said so) indices are still
    leased, as on a CPU testbed node."""
    first, held = gpus.claim([0, 1], 2, {**OWNER, "user": "alice"}, {})
    assert first["visible"] == "0,1" and (first["by"], first["nvml"]) == ("listed", False)
    try:
        second, more = gpus.claim("auto", 2, {"job_id": "second"}, {})
        assert second["indices"] == [2, 3], second
        assert list(second["skipped"]) == ["0-1"] and second["by"] == "auto", second
        assert second["skipped"]["0-1"].startswith("job 20261201-0930-ab12 ("), second
        GPUS("gpus", second)  # (what the head accepts: raises BadReply if not)
        for lease in more:
            lease.release()
        with pytest.raises(GuardError) as info:
            gpus.claim([1, 2], 2, {"job_id": "third"}, {})
        assert info.value.busy
        assert (info.value.code, info.value.fields["need"], info.value.fields["free"]) == (
            "guard.gpus-busy", "2", "1")
        assert leases.describe(leases.holder("gpu-1")) in info.value.fields["held"]
        assert "run --wait" in info.value.fix
        assert leases.holder("gpu-2") is None  # what it had taken is given back
    finally:
        for lease in held:
            lease.release()
    assert gpus.claim(None, 2, OWNER, {}) == ({}, [])  # a CPU node that asked for nothing
    chosen, none = gpus.claim("auto", 2, OWNER, {"CUDA_VISIBLE_DEVICES": "3"})
    assert chosen["visible"] == "3" and none == []  # Slurm's (or the user's) choice stands


def test_a_gpu_with_a_process_outside_ptcluster_is_skipped_and_named(lease_dir,
                                                                     monkeypatch) -> None:
    """A 4-GPU node as NVML would describe it (the machine has no GPU: the two NVML reads are
    replaced by their answers; the rest is real)."""
    monkeypatch.setattr(gpus, "gpus", lambda: {"count": 4})
    monkeypatch.setattr(gpus, "compute_processes",
                        lambda: ({0: [{"pid": os.getpid(), "mib": 31 * 1024}], 1: []}, None))
    chosen, held = gpus.claim("auto", 2, OWNER, {})
    try:
        assert chosen["indices"] == [1, 2]
        assert f"skipped 0: pid {os.getpid()} (root, 31 GiB)" in chosen["why"], chosen
        with pytest.raises(GuardError) as info:
            gpus.claim("auto", 3, OWNER, {})
        assert info.value.code == "guard.gpus-busy"
        assert (info.value.fields["need"], info.value.fields["free"]) == ("3", "1")
        assert f"GPU 0 is in use by pid {os.getpid()} (root, 31 GiB)" in \
            info.value.fields["held"]
        with pytest.raises(GuardError) as info:
            gpus.claim([3, 7], 2, OWNER, {})
        assert (info.value.code, info.value.fields["missing"]) == ("guard.gpu-not-there", "7")
    finally:
        for lease in held:
            lease.release()


def test_a_gpu_leased_by_another_job_is_named_by_its_job_with_its_memory(lease_dir,
                                                                         monkeypatch) -> None:
    """A 4-GPU node as NVML would describe it. NVML cannot run here (no GPU, no driver): its
    two reads, the GPU count and the compute-process table, are replaced by their answers;
    the leases are real. alice's job holds GPUs 0-1 and its ranks are NVML compute processes
    there (16 + 15 GiB); GPU 3 has a process that no lease covers. A leased GPU is named by
    its job (and what its processes use), never by a pid; only GPU 3 is named by its pid."""
    outsider = subprocess.Popen(["sleep", "60"])
    ranks = os.getpid()  # (stands in for alice's ranks: whose they are is not asked)
    table = {0: [{"pid": ranks, "mib": 16 * 1024}], 1: [{"pid": ranks, "mib": 15 * 1024}],
             2: [], 3: [{"pid": outsider.pid, "mib": 12 * 1024}]}
    monkeypatch.setattr(gpus, "gpus", lambda: {"count": 4})
    held: list[leases.Lease] = []
    try:
        monkeypatch.setattr(gpus, "compute_processes", lambda: ({0: [], 1: []}, None))
        alices, held = gpus.claim([0, 1], 2, {**OWNER, "user": "alice"}, {})
        assert alices["indices"] == [0, 1]
        monkeypatch.setattr(gpus, "compute_processes", lambda: (table, None))
        record = leases.holder("gpu-0")
        assert record is not None
        since = time.strftime("%H:%M", time.localtime(record["since"]))
        # (the user named is the record's uid's, not what the record says: root's, here)
        job = f"job 20261201-0930-ab12 (root, python train.py, since {since}, 31 GiB, " \
              "head laptop)"
        with pytest.raises(GuardError) as info:
            gpus.claim([0, 1, 2, 3], 4, {"job_id": "bobs", "user": "bob"}, {})
        problem = info.value.problem
        assert problem == f"4 GPU(s) asked for, 1 free: GPUs 0-1 are in use by {job}; " \
            f"GPU 3 is in use by pid {outsider.pid} (root, 12 GiB)", problem
        assert f"pid {ranks}" not in problem
        assert info.value.fix.endswith("or ask root"), info.value.fix
        assert leases.holder("gpu-2") is None and leases.holder("gpu-3") is None
        chosen, mine = gpus.claim("auto", 1, {"job_id": "bobs", "user": "bob"}, {})
        held += mine
        assert chosen["indices"] == [2]
        assert chosen["why"] == f"auto: the first 1 free (skipped 0-1: {job})", chosen
    finally:
        for lease in held:
            lease.release()
        outsider.kill()
        outsider.wait()


def test_spans() -> None:
    assert gpus.spans([3, 0, 1, 2, 6]) == "0-3,6" and gpus.spans([]) == ""


def test_ps_rows_count_each_lease_once_on_the_node_it_names() -> None:
    """Two nodes whose sessions read one shared lock directory (both see every lease)."""
    def rec(node, resource, **kw):
        return {"job_id": "J1", "user": "alice", "head": "laptop", "command": "python t.py",
                "since": 100.0, "node": node, "resource": resource, **kw}

    leases_seen = [rec("h1", "job-J1", ranks=[0, 1]), rec("h1", "gpu-3"), rec("h1", "gpu-2"),
                   rec("h1", "port-29501"), rec("h2", "job-J1", ranks=[2, 2], since=101.0),
                   rec("h2", "gpu-0"),
                   {**rec("h2", "job-J2", ranks=[0, 0]), "job_id": "J2", "user": "bob",
                    "since": 50.0}]
    rows = job_rows({"n1": ("h1", "bob", leases_seen), "n2": ("h2", "bob", leases_seen)})
    assert [r.job_id for r in rows] == ["J2", "J1"]  # oldest first
    j2, j1 = rows
    assert j2.mine and not j1.mine and j2.nodes == ["n2"] and j2.ranks == 1
    assert j1.nodes == ["n1", "n2"] and j1.ranks == 3 and j1.port == 29501
    assert j1.gpus == {"n1": [2, 3], "n2": [0]} and j1.started == 100.0
    # A malformed record never reaches job_rows: the head's one check of a sampled lease
    # (records.sampled, in remote.replies.sample_reply) drops it first.
    bad = [{**rec("h1", "job-J3", since="soon"), "job_id": "J3"}, [1],
           {**rec("h1", "job-J4", ranks=["x", 1]), "job_id": "J4"},
           {**rec("h1", "job-J5", since=float("nan")), "job_id": "J5"}]
    good = {**rec("h1", "job-J6", ranks=[0, 1]), "job_id": "J6", "pid": 10, "uid": 1000}
    sent = [{**b, "pid": 10, "uid": 1000} if isinstance(b, dict) else b for b in bad]
    assert [r for r in [*sent, good] if sampled(r)] == [good]


def test_the_monitors_job_column_is_every_users_jobs_on_this_node() -> None:
    here = socket.gethostname()
    seen = [{"job_id": "J1", "user": "alice", "node": here, "resource": "job-J1",
             "ranks": [4, 7]},
            {"job_id": "J1", "user": "alice", "node": here, "resource": "gpu-5"},
            {"job_id": "J1", "user": "alice", "node": here, "resource": "gpu-4"},
            {"job_id": "J2", "user": "bob", "node": "elsewhere", "resource": "job-J2",
             "ranks": [0, 0]}]
    assert sampler.jobs(seen) == {"J1": {"user": "alice", "ranks": 4, "gpus": [4, 5]}}


def test_kill_by_another_user_is_refused_by_the_kernel_and_by_the_owner_works(tmp_path) -> None:
    """The job's guard (here a root process holding the job's lease) in a lock directory like
    /run/lock's; `kill`'s node program run as nobody is refused (EPERM), with who may; run as
    the owner, it signals the holder and leaves the note its guard reads."""
    src = Path(__file__).resolve().parents[2] / "src"
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv here (util-linux)")
    shared = Path(tempfile.mkdtemp(dir="/tmp", prefix="ptc-leases-"))
    os.chmod(shared, 0o1777)
    hold = ("import sys, time; sys.path[:0] = [sys.argv[2]]; "
            "from ptcluster.node.sharing import leases; "
            "leases.LEASE_DIR = sys.argv[1]; held = leases.take('job-J9', {'job_id': 'J9'}); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(shared), str(src), "guard", "J9"],
                              stdout=subprocess.PIPE, text=True)  # (a guard's last words)
    ask = ("import json, sys; from ptcluster.node import kill; "
           "from ptcluster.node.sharing import leases; "
           "leases.LEASE_DIR = sys.argv[1]; "
           "print(json.dumps(kill.end_job('J9', 'TERM', {'host': 'h9', 'user': sys.argv[2]})))")
    try:
        assert holder.stdout.readline().strip() == "held"
        as_nobody = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
             "-c", ask, str(shared), "nobody"], env={"PYTHONPATH": str(src)},
            capture_output=True, text=True, timeout=30)
        if as_nobody.returncode and "Permission denied" in as_nobody.stderr:
            pytest.skip(f"nobody cannot read {src} here")
        refused = json.loads(as_nobody.stdout)
        assert refused["found"] and refused["signalled"] is False, refused
        assert refused["error"] == "job J9 is root's: only root may end it", refused
        assert (refused["problem"]["code"], refused["problem"]["fields"]) == (
            "kill.not-yours", {"job_id": "J9", "owner": "root", "allowed": "root"}), refused
        assert holder.poll() is None  # untouched
        assert not list(shared.glob("ptcluster-kill-*"))  # nobody's note went with the refusal
        mine = subprocess.run([sys.executable, "-c", ask, str(shared), "root"],
                              env={**os.environ, "PYTHONPATH": str(src)},
                              capture_output=True, text=True, timeout=30)
        assert json.loads(mine.stdout)["signalled"], mine.stdout + mine.stderr
        assert holder.wait(timeout=10) == -signal.SIGTERM
        (note,) = shared.glob("ptcluster-kill-J9@*.json")
        assert json.loads(note.read_text())["user"] == "root"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        shutil.rmtree(shared, ignore_errors=True)


def test_a_job_runs_unleased_only_when_its_user_opted_out(tmp_path, monkeypatch) -> None:
    """No lease directory to be had (no /run to make /run/lock in): refused, never silently
    unleased; with ``run --no-leases`` (the guard's config says ``leases: false``) the leasing
    stands in and the ready facts say so, as unsafe."""
    from ptcluster.node.guard.prechecks import job_leasing

    monkeypatch.setattr(leases, "LEASE_DIR", str(tmp_path / "no-run" / "lock"))
    with pytest.raises(OSError, match="cannot be made: No such file or directory"):
        leases.Leasing()
    with pytest.raises(GuardError) as info:
        job_leasing({})
    assert info.value.code == "guard.lease-dir-untrusted" and not info.value.busy
    assert info.value.fix == UNLEASED_FIX
    leasing = job_leasing({"leases": False})
    assert leasing.off == leases.NO_LEASES and "unsafe" in leasing.off
    chosen, held = gpus.claim([0], 1, OWNER, {}, leasing)
    assert chosen["indices"] == [0] and chosen["leased"] is False, chosen
    port, lease = lease_master_port("auto", OWNER, leasing)
    assert 29500 <= port < 30000 and leasing.holder(f"port-{port}") is None
    for one in [*held, lease]:
        one.release()  # nothing to release: no error either


def test_a_lease_leaves_no_file_behind_and_a_dead_holder_s_files_are_swept(lease_dir) -> None:
    """Only ``ptcluster-`` files are ours: the lease directory is the system's /run/lock, where
    other programs' locks and files (``LCK..ttyS0``, ``x.lock``, ``x.1.json``) stay as they
    are, even for root's sweep."""
    lease = leases.take("job-20261201-0930-ab12", OWNER)
    assert lease is not None and len(os.listdir(lease_dir)) == 2  # the lock and its record
    lease.release()
    assert os.listdir(lease_dir) == []  # a box running jobs for months gathers nothing
    # A holder SIGKILLed (the kernel drops its lock, its files stay): the next guard's
    # Leasing sweeps them; a held lease and the kill note of a running job are left alone.
    proc = holder_process(lease_dir, "job-dead")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    finally:
        proc.kill()
        proc.wait()
    held = leases.take("gpu-0", OWNER)
    job = leases.take("job-20261201-0930-ab12", OWNER)
    note = Path(leases.kill_note("20261201-0930-ab12", str(lease_dir)))
    note.write_text("{}")  # (its job runs: its guard reads it)
    stale = Path(leases.kill_note("20261201-0931-cd34", str(lease_dir)))
    stale.write_text("{}")  # (its job has ended)
    assert any(e.startswith("ptcluster-job-dead@") for e in os.listdir(lease_dir))
    theirs = {"LCK..ttyS0": "  4242\n", "other.lock": "", "other.1.json": "{}",
              "ptcluster": None}
    for entry, text in theirs.items():
        (lease_dir / entry).mkdir() if text is None else (lease_dir / entry).write_text(text)
    leases.Leasing()
    left = sorted(os.listdir(lease_dir))
    assert not any(e.startswith("ptcluster-job-dead@") for e in left), left
    assert any(e.startswith("ptcluster-gpu-0@") and e.endswith(".lock") for e in left)
    assert note.exists() and not stale.exists() and set(theirs) <= set(left), left
    assert sorted(r["resource"] for r in leases.held_all()) == ["gpu-0",
                                                                "job-20261201-0930-ab12"]
    assert job is not None
    job.release()
    assert leases.holder("gpu-0") is not None
    assert held is not None
    held.release()


def test_a_lock_file_removed_as_it_is_taken_is_taken_again_at_its_path(lease_dir,
                                                                      monkeypatch) -> None:
    # Between our open and our flock, its holder released it (unlinked, closed) and a third
    # process made a fresh one: a lock on the unlinked file would be a lease nobody else sees.
    real, raced = leases.fcntl.flock, []

    def racing_flock(fd: int, op: int) -> None:
        if not raced:
            raced.append(fd)
            path = lease_dir / f"{leases.lease_name('gpu-1')}.lock"
            path.unlink()
            path.touch(mode=0o444)
        real(fd, op)

    monkeypatch.setattr(leases.fcntl, "flock", racing_flock)
    lease = leases.take("gpu-1", OWNER)
    assert raced and lease is not None
    lock = lease_dir / f"{leases.lease_name('gpu-1')}.lock"
    assert os.fstat(lease.fd).st_ino == lock.stat().st_ino  # the file at the path is locked
    monkeypatch.setattr(leases.fcntl, "flock", real)
    assert leases.holder("gpu-1") is not None
    lease.release()


def test_a_holder_with_umask_077_still_leaves_its_lease_readable_by_everyone(lease_dir) -> None:
    # Another user must open the lock file (to try its lock) and read the record (to say who
    # holds it); a private umask would hide both, and that user's job would take the GPU.
    old = os.umask(0o077)
    try:
        lease = leases.take("gpu-5", OWNER)
    finally:
        os.umask(old)
    assert lease is not None
    try:
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in lease_dir.iterdir()}
        assert sorted(modes.values()) == ["0o444", "0o644"], modes
    finally:
        lease.release()


def test_records_are_written_whole_and_read_only_from_regular_files(tmp_path) -> None:
    """The one record directory code (leases, the heads' registry): a planted link is replaced,
    never followed; a planted FIFO is not waited on; the mode holds whatever the umask."""
    from ptcluster.node.sharing import records

    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "r.json").symlink_to(target)
    old = os.umask(0o077)
    try:
        records.write_record(str(tmp_path / "r.json"), {"pid": os.getpid()}, 0o644)
    finally:
        os.umask(old)
    assert target.read_text() == "keep" and not (tmp_path / "r.json").is_symlink()
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644
    assert records.read_record(str(tmp_path / "r.json")) == ({"pid": os.getpid()}, os.getuid())
    (tmp_path / "link.json").symlink_to(tmp_path / "r.json")
    os.mkfifo(tmp_path / "fifo.json")
    assert records.read_record(str(tmp_path / "link.json")) is None
    assert records.read_record(str(tmp_path / "fifo.json")) is None  # (returns at once)
    assert records.alive(os.getpid()) and not records.alive(2 ** 22 + 12345)
    assert not records.alive("1") and not records.alive(0)
    records.unlink(str(tmp_path / "r.json"))
    records.unlink(str(tmp_path / "r.json"))  # gone already: fine
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_a_guard_removes_its_lease_files_as_it_ends_finished_or_refused(tmp_path) -> None:
    """A local job (its guard leases in the real /run/lock) that finishes, and one refused
    because the first one's port is held: neither leaves a ``ptcluster-*`` file of its job in
    /run/lock (before, every job left its lock files and records for the next guard's sweep)."""
    from tests.support.head import only_run, run_head

    if not os.access("/run/lock", os.W_OK):
        pytest.skip("/run/lock is not writable here")
    free = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free.append(s.getsockname()[1])
    port = leases.take(f"port-{free[1]}", OWNER)  # (held, so the second job is refused)
    script = tmp_path / "job.py"
    script.write_text("print('ran', flush=True)\n")
    jobs = []
    try:
        for n, args in enumerate((["--port", str(free[0])], ["--port", str(free[1])])):
            runs = tmp_path / f"runs{n}"
            code, head = run_head(["run", "--nproc", "1", *args, "--run-dir", str(runs),
                                   str(script)], tmp_path, timeout=120)
            assert code == n, head.output()  # the first runs (0), the second is refused (1)
            jobs.append(only_run(runs)[0])
    finally:
        if port:
            port.release()
    left = [p.name for p in Path("/run/lock").glob("ptcluster-*") if any(j in p.name
                                                                          for j in jobs)]
    assert jobs and left == [], left
