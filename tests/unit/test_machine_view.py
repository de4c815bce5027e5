"""How the head words what the machine saw of a rank's death (``launch.supervise.machine_view``,
through ``verdict.judge_rank``): the guard's facts in, message, fix and kind out."""

from __future__ import annotations

import pytest

from ptcluster.launch.result import FailureKind, RankRecord
from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.machine_view import disk_named, oom_named, size
from ptcluster.launch.supervise.verdict import Raised, judge_rank

WORKER = "RuntimeError: DataLoader worker (pid(s) 4242) is killed by signal: Killed. "
VICTIM = {"pid": 4242, "comm": "pt_main_thread", "rss": 12025908428, "main": False,
          "constraint": "CONSTRAINT_NONE", "memcg": "/"}
NODE = {"node_kills": 1, "group_kills": 0, "log": "/dev/kmsg", "mem_available": 322122547,
        "mem_total": 16750372454}


@pytest.mark.parametrize(("n", "said"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                         (67108864, "64.0 MiB"), (12025908428, "11.2 GiB")])
def test_sizes(n: int, said: str) -> None:
    assert size(n) == said


def test_a_dataloader_worker_killed_on_a_full_node() -> None:
    named = oom_named("n2", 1, {**NODE, "victims": [VICTIM]}, WORKER.strip())
    assert named is not None and named.kind == "oom"
    assert named.message.startswith(
        "killed by the kernel's out-of-memory killer (its DataLoader worker, pid 4242, "
        "pt_main_thread, 11.2 GiB resident; n2 had 307.2 MiB of 15.6 GiB available")
    assert named.problem.code == "run.oom-killed"
    assert named.problem.fields["then"] == f"; the rank then exited with code 1 ({WORKER.strip()})"
    assert named.problem.fields["host"] == "n2"  # (the node's memory: its fix names it)
    assert named.facts["oom"]["victims"][0]["pid"] == 4242


def test_the_rank_itself_killed_in_its_memory_group() -> None:
    victim = {**VICTIM, "main": True, "comm": "python", "rss": 80633856,
              "constraint": "CONSTRAINT_MEMCG", "memcg": "/job"}
    named = oom_named("n1", -9, {**NODE, "group_kills": 1, "group_limit": 67108864,
                                 "victims": [victim]}, "")
    assert named is not None
    assert named.message == ("killed by the kernel's out-of-memory killer (pid 4242, python, "
                             "76.9 MiB resident; its memory group /job is limited to 64.0 MiB)")
    assert named.problem.code == "run.oom-killed-group" and named.problem.fields["then"] == ""


def test_a_victim_tied_by_group_is_said_probable_and_only_for_a_worker_death() -> None:
    """No look of the guard's saw the process (issue 45 item 5): named as the rank's, said to
    be less sure, and only when the rank's own end says a process of its died."""
    tied = {**VICTIM, "tied": "group", "constraint": "CONSTRAINT_MEMCG", "memcg": "/job"}
    named = oom_named("n2", 1, {**NODE, "victims": [tied]}, WORKER.strip())
    assert named is not None and named.message.startswith(
        "killed by the kernel's out-of-memory killer (probably its DataLoader worker, pid "
        "4242, pt_main_thread: it lived between two of the guard's looks, tied to the rank by "
        "its user and memory group in the kernel's record")
    assert oom_named("n2", 1, {**NODE, "victims": [tied]}, "ValueError: bad") is None
    assert oom_named("n2", -9, {**NODE, "victims": [tied]}, "") is not None


def test_a_log_that_names_none_of_its_processes_is_not_its_oom() -> None:
    assert oom_named("n1", -9, {**NODE, "victims": []}, "") is None


@pytest.mark.parametrize(("code", "raised", "named"), [
    (-9, "", True), (None, "", True), (1, WORKER, True),
    (1, "ValueError: bad", False), (-15, "", False),
])
def test_where_the_log_is_unreadable_the_count_is_said(code, raised, named) -> None:
    oom = {**NODE, "log": "", "victims": [], "group_kills": 1, "group_limit": 67108864}
    got = oom_named("n3", code, oom, raised)
    assert (got is not None) == named
    if got is not None:
        assert got.problem.code == "run.oom-counted-group"
        assert got.problem.fields["counts"] == ("the node's OOM-kill count rose by 1, its memory "
                                                "group's by 1, a group limited to 64.0 MiB")
        assert "sudo dmesg" in got.fix and "group adm" in got.fix


def test_a_full_disk_names_the_filesystem_with_its_space() -> None:
    disk = {"path": "/ck/checkpoint-2.pt", "mount": "/ck", "fstype": "tmpfs", "source": "tmpfs",
            "free": 679936, "total": 3145728}
    text = "OSError: [Errno 28] No space left on device: 'ck/checkpoint-2.pt'"
    named = disk_named("n1", 28, disk, text)
    assert named is not None and named.kind == "disk" and named.problem.code == "run.disk-full"
    assert named.message == (f"{text}; the filesystem is full: /ck (tmpfs) on n1 now has "
                             "664.0 KiB free of 3.0 MiB")
    assert named.fix.startswith("free space on n1's /ck")
    assert disk_named("n1", 2, disk, "FileNotFoundError") is None
    unnamed = disk_named("n1", 122, {"full": [disk]}, "OSError: [Errno 122] Disk quota exceeded")
    assert unnamed is not None and unnamed.problem.code == "run.disk-full-unnamed"
    assert unnamed.problem.fields["what"] == "quota"
    assert unnamed.problem.fields["where"] == \
        "nearly full on n1: /ck (tmpfs) 664.0 KiB free of 3.0 MiB"


def test_judge_rank_takes_the_machines_word_first() -> None:
    record = RankRecord(rank=3, host="n2", local_rank=1, started_at=1.0, exit_code=-9,
                        ended_at=5.0)
    plain = judge_rank(record, None, False, None)
    assert plain is not None and plain.message == "killed by SIGKILL"
    assert plain.kind is FailureKind.RANK
    oom = judge_rank(record, None, False, None, {**NODE, "victims": [{**VICTIM, "main": True}]})
    assert oom is not None and oom.kind is FailureKind.OOM and oom.facts["oom"]["node_kills"] == 1
    record.exit_code = 1
    full = judge_rank(record, Raised(4.0, "OSError: [Errno 28] No space left on device",
                                     errno=28, disk={"mount": "/", "free": 0, "total": 1 << 30}),
                      False, None)
    assert full is not None and full.kind is FailureKind.DISK and full.at == 4.0
    assert full.declared is not None and full.declared.code == "run.disk-full"
    assert {k: full.declared.fields[k] for k in ("mount", "fstype", "host", "free", "total")} == \
        {"mount": "/", "fstype": "?", "host": "n2", "free": "0 B", "total": "1.0 GiB"}


@pytest.mark.parametrize(("line", "expected"), [
    ('rexit {"rank":2,"code":-9,"t":5.5,"duration":1.25,"oom":{"node_kills":1,"log":"",'
     '"victims":[]}}',
     ev.RankExit("n", 2, -9, 5.5, 1.25, {"node_kills": 1, "log": "", "victims": []})),
    ('rerror {"rank":1,"t":4.0,"text":"OSError: [Errno 28] No space left on device","exc":'
     '"OSError","errno":28,"filename":"/ck/c.pt","disk":{"mount":"/ck","free":0,"total":9}}',
     ev.RankError("n", 1, 4.0, "OSError: [Errno 28] No space left on device", "OSError", 28,
                  "/ck/c.pt", {"mount": "/ck", "free": 0, "total": 9})),
    ('rerror {"rank":1,"t":4.0,"text":"RuntimeError: x","exc":"RuntimeError"}',
     ev.RankError("n", 1, 4.0, "RuntimeError: x", "RuntimeError")),
])
def test_the_guards_facts_are_decoded(line: str, expected: ev.Event) -> None:
    assert ev.decode("n", line) == expected


OOMD_LINES = [
    # systemd 252 (Debian 12) and 255 say "Killed", newer ones "Marked … for killing"
    "Killed /user.slice/user-1000.slice/user@1000.service/app.slice/train.scope due to memory "
    "pressure for /user.slice/user-1000.slice/user@1000.service being 72.31% > 50.00% for > 20s "
    "with reclaim activity",
    "Marked /system.slice/ptjob.service for killing due to memory pressure for /system.slice "
    "being 81.02% > 60.00% for > 30s with reclaim activity",
    "Considered 12 cgroups for killing, top candidates were:",
]


def test_systemd_oomds_kills_are_read_from_its_lines() -> None:
    from ptcluster.node.facts.kernel_log import oomd_lines, within

    kills = oomd_lines(OOMD_LINES)
    assert [cg for cg, _ in kills] == [
        "/user.slice/user-1000.slice/user@1000.service/app.slice/train.scope",
        "/system.slice/ptjob.service"]
    assert kills[0][1].startswith("memory pressure for /user.slice/user-1000.slice/")
    # a rank's group is the killed one or below it; a sibling is not
    assert within("/system.slice/ptjob.service", "/system.slice/ptjob.service")
    assert within("/system.slice/ptjob.service/rank0", "/system.slice/ptjob.service")
    assert not within("/system.slice/ptjob.service2", "/system.slice/ptjob.service")


def test_a_rank_systemd_oomd_killed_is_named_so() -> None:
    oom = {"node_kills": 0, "group_kills": 0, "log": "journalctl -k", "victims": [],
           "oomd": {"group": "/system.slice/ptjob.service",
                    "why": "memory pressure for /system.slice being 81.02% > 60.00% for > 30s "
                           "with reclaim activity"}}
    named = oom_named("n2", -9, oom, "")
    assert named is not None and named.kind == "oom"
    assert named.message == (
        "killed by systemd-oomd, which ended the whole control group /system.slice/ptjob.service "
        "on n2 (due to memory pressure for /system.slice being 81.02% > 60.00% for > 30s with "
        "reclaim activity); the kernel's own out-of-memory killer did not run")
    assert "ManagedOOMMemoryPressureLimit=" in named.fix
