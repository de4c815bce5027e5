"""What the machine saw of a rank's death, for real: the kernel's OOM killer (a rank in a cgroup
v1 memory group with a small limit), named from ``/dev/kmsg`` as root and as "the count rose"
for a user who cannot read the log; a DataLoader worker's OOM; a full checkpoint disk (a tiny
tmpfs) named with its free space, the previous checkpoint intact, ``--resume`` continuing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ptcluster.launch.supervise.machine_view import size
from tests.support.head import only_run, rank_fields, run_head

MEMORY_V1 = Path("/sys/fs/cgroup/memory")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
SRC = Path(__file__).resolve().parents[2] / "src"

GROUP_HOG = textwrap.dedent("""
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # (the group's victim: this rank, not the head, guard or torchrun)
    hog = []
    while True:
        hog.append(bytearray(8 << 20))
""")

WORKER_HOG = textwrap.dedent("""
    import os, sys, time
    from torch.utils.data import DataLoader, Dataset

    class Hog(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            print(f"worker pid {os.getpid()} in the group", flush=True)
            # a worker moved into a group is counted there from the guard's next look at
            # its tree (each heartbeat, 1 s): five looks' time before it allocates
            time.sleep(5.0)
            hog = []
            while True:
                hog.append(bytearray(8 << 20))

    for _ in DataLoader(Hog(), num_workers=1):
        pass
""")


FLASH_HOG = textwrap.dedent("""
    import os
    from torch.utils.data import DataLoader, Dataset

    class Hog(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")  # (the kernel's victim in the group: this one, not torch's)
            print(f"worker pid {os.getpid()}", flush=True)
            hog = []
            while True:
                hog.append(bytearray(8 << 20))

    for _ in DataLoader(Hog(), num_workers=1):
        pass
""")


def _needs_root_and_memory_v1() -> None:
    if os.getuid() != 0 or not (MEMORY_V1 / "cgroup.procs").exists():
        pytest.skip("needs root and the cgroup v1 memory controller (TESTBED.md)")


@pytest.fixture
def memory_group() -> Iterator[Path]:
    """A fresh cgroup v1 memory group limited to 64 MiB; removed afterwards (its processes
    moved back to the root group first, were any left)."""
    _needs_root_and_memory_v1()
    group = MEMORY_V1 / f"ptc-test-oom-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(64 << 20))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (MEMORY_V1 / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _root_cause(runs: Path) -> dict:
    _, summary = only_run(runs)
    return summary["root_cause"]


def _said_pid(lines: list[str], pattern: str) -> int:
    for line in lines:
        if m := re.search(pattern, line):
            return int(m.group(1))
    raise AssertionError(f"no {pattern!r} in {lines[-20:]}")


def _in_group(memory_group: Path, args: list[str], cwd: Path,
              env: dict[str, str] | None = None, user: tuple[str, ...] = ()
              ) -> subprocess.CompletedProcess[str]:
    """``ptcluster ARGS`` with the whole job in ``memory_group`` (the head moves itself in
    first): the rank is in the group from its start, and the guard counts the group from the
    rank's start record, never from a look that must fall between a move and the kill."""
    return subprocess.run([*user, "sh", "-c", f'echo $$ > {memory_group}/cgroup.procs && '
                           'exec "$@"', "sh", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.slow
def test_a_rank_killed_by_the_oom_killer_is_named_from_the_kernel_log(
        tmp_path, memory_group, no_leftovers) -> None:
    (memory_group / "memory.limit_in_bytes").write_text(str(1 << 30))
    (tmp_path / "hog.py").write_text("import os\nprint(f'pid {os.getpid()} in the group', "
                                     "flush=True)\n" + GROUP_HOG)
    run = _in_group(memory_group, [sys.executable, "-m", "ptcluster", "run", "--nproc", "1",
                                   "--run-dir", "runs", "hog.py"], tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    pid = _said_pid(run.stdout.splitlines(), r"\] pid (\d+) in the group")
    job_id, _ = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    rc = _root_cause(tmp_path / "runs")
    assert rc["kind"] == "oom" and rc["rank"] == 0 and rc["exit_code"] == -9
    (victim,) = rc["facts"]["oom"]["victims"]
    assert victim["pid"] == pid and victim["main"] and victim["comm"] == "python"
    assert victim["constraint"] == "CONSTRAINT_MEMCG" and victim["rss"] > 32 << 20
    assert rc["facts"]["oom"]["log"] == "/dev/kmsg" and rc["facts"]["oom"]["group_kills"] == 1
    assert rc["code"] == "run.oom-killed-group", rc
    assert {k: rc["fields"][k] for k in ("victim", "more", "room", "then")} == {
        "victim": f"pid {pid}, python, {size(victim['rss'])} resident", "more": "",
        "room": f"its memory group /{memory_group.name} is limited to 1.0 GiB", "then": ""}
    assert any(line.startswith("Root cause (first observed failure): rank 0 on localhost: "
                               "killed by the kernel's out-of-memory killer") for line in
               run.stderr.splitlines()), run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("groups", ["--clear-groups", "--groups=adm"])
def test_a_user_who_cannot_read_the_log_is_told_the_count_rose(memory_group, groups) -> None:
    """nobody; and nobody in group adm, whose ``journalctl -k`` shows nothing here (no
    journald): a log that shows none of the kills the node counted is no log."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv here (util-linux)")
    if groups == "--groups=adm" and shutil.which("journalctl") is None:
        pytest.skip("no journalctl here")
    tmp_path = Path(tempfile.mkdtemp(prefix="ptc-oom-nobody-", dir="/tmp"))  # nobody's to use
    try:
        _as_nobody(tmp_path, memory_group, [*NOBODY[:-1], groups])
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _as_nobody(tmp_path: Path, memory_group: Path, nobody: list[str]) -> None:
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(SRC), *site])}
    if subprocess.run([*nobody, "/usr/bin/python3", "-c", "import torch, ptcluster.cli"],
                      cwd="/", env=env, capture_output=True, timeout=60).returncode:
        pytest.skip("nobody cannot run this checkout's ptcluster with /usr/bin/python3")
    # The whole job starts in the group (the head moves itself in, then runs ptcluster): the
    # rank is in it from its start, so the guard counts its group from the rank's start record,
    # never from a look that must come between a move and the kill (a CI run: group_kills 0
    # after a 5 s wait). The hog makes itself the group's victim.
    (memory_group / "memory.limit_in_bytes").write_text(str(1 << 30))
    (tmp_path / "hog.py").write_text(GROUP_HOG)
    os.chown(tmp_path, 65534, 65534)
    os.chown(memory_group / "cgroup.procs", 65534, 65534)
    run = _in_group(memory_group, ["/usr/bin/python3", "-m", "ptcluster", "run", "--nproc",
                                   "1", "--run-dir", "runs", "hog.py"], tmp_path, env,
                    tuple(nobody))
    assert run.returncode == 1, run.stdout + run.stderr
    rc = _root_cause(tmp_path / "runs")
    assert rc["kind"] == "oom" and rc["exit_code"] == -9
    oom = rc["facts"]["oom"]
    assert oom["log"] == "" and oom["victims"] == [] and oom["group_kills"] == 1
    assert oom["node_kills"] >= 1
    assert oom["group_limit"] == 1 << 30  # (the message's "a group limited to 1.0 GiB")
    assert rc["code"] == "run.oom-counted-group", rc  # (its fix: how to read the log there)
    assert {k: rc["fields"][k] for k in ("how", "host")} == {
        "how": "killed by SIGKILL", "host": "localhost"}
    assert rc["fields"]["counts"] == (
        f"the node's OOM-kill count rose by {oom['node_kills']}, its memory group's by 1, a "
        "group limited to 1.0 GiB")
    assert rc["message"] in run.stderr  # (the console says what summary.json says)


@pytest.mark.slow
def test_a_dataloader_workers_oom_is_named_with_the_workers_pid(tmp_path, memory_group,
                                                                no_leftovers) -> None:
    (tmp_path / "loader.py").write_text(WORKER_HOG)
    code, head = run_head(["run", "--nproc", "1", "--run-dir", "runs", "loader.py",
                           str(memory_group)], cwd=tmp_path, timeout=120)
    job_id, _ = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    worker = _said_pid(head.lines, r"worker pid (\d+) in the group")
    rc = _root_cause(tmp_path / "runs")
    assert rc["kind"] == "oom" and rc["exit_code"] == 1, rc
    (victim,) = rc["facts"]["oom"]["victims"]
    assert victim["pid"] == worker and not victim["main"]
    assert rc["code"] == "run.oom-killed-group", rc
    assert rc["fields"]["victim"].startswith(f"its DataLoader worker, pid {worker}, "), rc
    # (torch says "is killed by signal: Killed" or "exited unexpectedly", as it notices)
    assert rc["fields"]["then"].startswith(
        f"; the rank then exited with code 1 (RuntimeError: DataLoader worker (pid(s) {worker})")


@pytest.fixture
def tiny_tmpfs(tmp_path) -> Iterator[Path]:
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder = tmp_path / "ck"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.slow
def test_a_full_checkpoint_disk_is_named_and_resume_continues(tmp_path, tiny_tmpfs,
                                                              no_leftovers) -> None:
    """Checkpoints of about 1.2 MB on a 3 MiB tmpfs: the third save fails (two are kept)."""
    common = ["-m", "ptcluster.examples.mnist", "--dataset", "digits", "--checkpoint-dir",
              str(tiny_tmpfs)]
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "r1", "--max-restarts", "1",
                           *common, "--epochs", "3"], cwd=tmp_path, timeout=240)
    job_id, summary = only_run(tmp_path / "r1")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    # the restart's health gate finds no room for another checkpoint there: no second try
    first, second = summary["attempts"]
    assert first["checkpoint_paths"] == {"localhost": str(tiny_tmpfs)}
    assert second["cause"]["kind"] == "unhealthy", second
    assert second["cause"]["message"].startswith(
        "its checkpoint disk has no room for another checkpoint: "), second
    assert f" of 3.0 MiB free on the filesystem of {tiny_tmpfs}, its largest checkpoint " \
        "file is 1." in second["cause"]["message"]
    rc = first["cause"]
    assert rc["kind"] == "disk" and rc["rank"] == 0, rc
    disk = rc["facts"]["disk"]
    assert disk["mount"] == str(tiny_tmpfs) and disk["fstype"] == "tmpfs"
    assert disk["total"] == 3 << 20 and disk["free"] < 2 << 20
    assert disk["path"] == str(tiny_tmpfs / "checkpoint-2.pt")
    assert rc["code"] == "run.disk-full", rc
    fields = rc["fields"]
    assert fields["raised"].startswith("OSError: [Errno 28] No space left on device: ")
    assert {k: fields[k] for k in ("what", "mount", "fstype", "host", "free", "total")} == {
        "what": "filesystem", "mount": str(tiny_tmpfs), "fstype": "tmpfs", "host": "localhost",
        "free": size(disk["free"]), "total": "3.0 MiB"}
    # No partial file; the last good checkpoint is whole (torch loads it).
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["checkpoint-0.pt", "checkpoint-1.pt"]
    import torch

    state = torch.load(tiny_tmpfs / "checkpoint-1.pt", weights_only=True)
    assert state["epoch"] == 1
    subprocess.run(["mount", "-o", "remount,size=8m", str(tiny_tmpfs)], check=True)
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "r2", *common, "--epochs", "4",
                           "--resume"], cwd=tmp_path, timeout=240)
    job_id, summary = only_run(tmp_path / "r2")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    assert {f["start_epoch"] for f in rank_fields(head.lines).values()} == {"2"}
    assert any("resumed from" in line and "checkpoint-1.pt" in line for line in head.lines)
    assert json.loads(json.dumps(summary))["ok"] is True


def test_an_oom_kill_or_xid_forged_in_a_groups_name_is_not_read() -> None:
    """M2: the kernel prints control groups' paths (free text in a delegated group) in other
    lines; a kill or an Xid is read only at the start of the kernel's record."""
    from ptcluster.node.guard.machine import MachineWatch

    watch = MachineWatch()
    try:
        for line in [
            "Memory cgroup stats for /user.slice/u/Out of memory: Killed process 1 (systemd) "
            "total-vm:1kB, anon-rss:99999999kB, file-rss:0kB, shmem-rss:0kB, UID:0:",
            "Memory cgroup stats for /user.slice/u/NVRM: Xid (PCI:0000:3b:00): 79, x:",
            "oom-kill:constraint=CONSTRAINT_MEMCG,oom_memcg=/u/Killed process 1 (init) x,"
            "task_memcg=/u,task=leaker,pid=23793,uid=0",
            "Memory cgroup out of memory: Killed process 23793 (a) b) total-vm:1kB, "
            "anon-rss:4kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:1104kB oom_score_adj:0",
        ]:
            watch.parse(line)
    finally:
        watch.close()
    assert watch.xids == []
    assert watch.kills == [{"pid": 23793, "comm": "a) b", "rss": 4 * 1024,
                            "constraint": "CONSTRAINT_MEMCG", "memcg": "/u/Killed process 1 "
                            "(init) x", "task_memcg": "/u", "uid": 0}]


def test_kernel_oom_lines_are_read_by_pid() -> None:
    """The two kernel lines of a kill (recorded formats: memcg and global), paired by pid."""
    from ptcluster.node.guard.machine import MachineWatch

    watch = MachineWatch()
    try:
        for line in [
            "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
            "oom_memcg=/leaker,task_memcg=/leaker,task=leaker,pid=23793,uid=0",
            "Memory cgroup out of memory: Killed process 23793 (leaker) total-vm:2623712kB, "
            "anon-rss:506500kB, file-rss:1268kB, shmem-rss:0kB, UID:0 pgtables:1104kB "
            "oom_score_adj:0",
            "Out of memory: Killed process 352226 (pt_main_thread) total-vm:22982348kB, "
            "anon-rss:15904644kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:33000kB "
            "oom_score_adj:0",
            "oom_reaper: reaped process 23793 (leaker), now anon-rss:0kB, file-rss:0kB",
        ]:
            watch.parse(line)
    finally:
        watch.close()
    assert watch.kills == [
        {"pid": 23793, "comm": "leaker", "rss": (506500 + 1268) * 1024,
         "constraint": "CONSTRAINT_MEMCG", "memcg": "/leaker", "task_memcg": "/leaker",
         "uid": 0},
        {"pid": 352226, "comm": "pt_main_thread", "rss": 15904644 * 1024, "uid": 1000},
    ]


@pytest.mark.slow
def test_a_worker_killed_between_two_looks_is_tied_to_its_rank_by_group(tmp_path,
                                                                        memory_group) -> None:
    """A DataLoader worker the OOM killer ends before any look of the guard's saw it (issue 45
    item 5): the whole job runs in a memory group of its own (the head started in it), the
    worker fills it at once. The kernel's record still names the worker's user and group,
    which are the rank's: the rank's end is named as the worker's OOM kill, and said to be
    less sure when no look saw it."""
    (memory_group / "memory.limit_in_bytes").write_text(str(1 << 30))
    (tmp_path / "flash.py").write_text(FLASH_HOG)
    run = subprocess.run(["sh", "-c", f'echo $$ > {memory_group}/cgroup.procs && exec "$@"',
                          "sh", sys.executable, "-m", "ptcluster", "run", "--nproc", "1",
                          "--run-dir", "runs", "flash.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 1, run.stdout + run.stderr
    worker = _said_pid(run.stdout.splitlines(), r"worker pid (\d+)")
    rc = _root_cause(tmp_path / "runs")
    assert rc["kind"] == "oom", rc
    (victim,) = rc["facts"]["oom"]["victims"]
    assert victim["pid"] == worker and not victim["main"] and victim["tied"] in ("tree", "group")
    whose = "probably its DataLoader worker" if victim["tied"] == "group" else \
        "its DataLoader worker"
    assert rc["code"] == "run.oom-killed-group", rc
    assert rc["fields"]["victim"].startswith(f"{whose}, pid {worker}, "), rc
    print("tied by", victim["tied"])  # (which way this run went: -s shows it)


@pytest.mark.parametrize("uid_shift, group, in_other_tree, tied", [
    (0, "/job", False, True),
    (1, "/job", False, False),  # another user's process
    (0, "/other", False, False),  # another memory group
    (0, "/job", True, False),  # a process another rank's tree had
])
def test_a_victim_no_look_saw_is_tied_by_user_and_group(uid_shift, group, in_other_tree,
                                                        tied) -> None:
    """The kernel's own two lines for a victim (mm/oom_kill.c's format, recorded), read by the
    guard's watch for a rank whose memory group is ``/job``: tied only when the record's user
    and task group are the rank's, and no rank's tree had the pid."""
    from ptcluster.node.guard.machine import MachineWatch
    from ptcluster.node.guard.schedstat import cgroup_mounts

    mount = cgroup_mounts("memory").get("v1") or cgroup_mounts("memory").get("v2")
    if mount is None:
        pytest.skip("no memory controller mounted")
    watch = MachineWatch()
    try:
        watch.groups[0] = {"file": f"{mount}/job/memory.oom_control", "base": 0, "limit": 0}
        watch.trees = {0: {10}, 1: {11, 4242} if in_other_tree else {11}}
        uid = os.getuid() + uid_shift
        watch.parse(f"oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
                    f"mems_allowed=0,oom_memcg={group},task_memcg={group},task=pt_data_worker,"
                    f"pid=4242,uid={uid}")
        watch.parse("Memory cgroup out of memory: Killed process 4242 (pt_data_worker) "
                    "total-vm:2097152kB, anon-rss:1048576kB, file-rss:0kB, shmem-rss:0kB, "
                    f"UID:{uid} pgtables:2100kB oom_score_adj:1000")
        got = watch.tied_by_group(0)
    finally:
        watch.close()
    assert got == ([{"pid": 4242, "comm": "pt_data_worker", "rss": 1 << 30,
                     "constraint": "CONSTRAINT_MEMCG", "memcg": group, "main": False,
                     "tied": "group"}] if tied else [])


def test_a_rank_gone_before_the_guard_saw_it_counts_from_the_guards_own_group() -> None:
    """A rank killed in its first moments, before its start record reached the guard: its
    memory group is the one it was started in (the guard's, inherited), counted from the
    watch's start, not from when the guard looked (then the kill was in the base: the CI
    suite's ``group_kills 0``). A rank seen alive in that group counts from there too."""
    from ptcluster.node.guard.machine import MachineWatch, memory_group

    watch = MachineWatch()
    own = memory_group(os.getpid())
    if own is None or watch.inherited is None:
        pytest.skip("no memory group readable here")
    gone = subprocess.Popen(["true"])
    gone.wait()  # (its /proc entry is gone: nothing to read its group from)
    watch.started(0, gone.pid, 0)
    assert watch.groups[0] == watch.inherited and watch.groups[0]["file"] == own[0]
    alive = subprocess.Popen(["sleep", "5"])
    try:
        watch.started(1, alive.pid, 0)
        assert watch.groups[1]["base"] == watch.inherited["base"]
    finally:
        alive.kill()
        alive.wait()
