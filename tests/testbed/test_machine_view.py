"""A real OOM kill of a rank on a testbed node, named with its node, pid and resident memory.

``ip netns exec`` remounts /sys, so a node sees no cgroups: the test moves the rank's pid into a
cgroup v1 memory group from the host (TESTBED.md, "The kernel's own view"). The node's guard
reads ``/proc/vmstat`` and ``/dev/kmsg`` (one kernel and one log for every node: the victim is
matched by pid, never by where it was read).
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.head import Head, job_id_when_started, only_run

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
MEMORY_V1 = Path("/sys/fs/cgroup/memory")
HOG = textwrap.dedent("""
    import os, sys, time
    if os.environ["RANK"] != "1":
        time.sleep(120)
        sys.exit(0)
    print(f"pid {os.getpid()} waits", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.1)
    time.sleep(1.5)  # the guard collects the rank's tree on each heartbeat
    hog = []
    while True:
        hog.append(bytearray(8 << 20))
""")


def test_an_oom_kill_on_a_node_names_the_rank_node_pid_and_rss(testbed, tmp_path,
                                                               no_leftovers) -> None:
    if not (MEMORY_V1 / "cgroup.procs").exists():
        pytest.skip("needs the cgroup v1 memory controller (TESTBED.md)")
    (tmp_path / "hog.py").write_text(HOG)
    cluster = testbed.write_cluster(tmp_path, (1, 1), python=sys.executable)
    group = MEMORY_V1 / f"ptc-testbed-oom-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    go = tmp_path / "go"
    runs = tmp_path / "runs"
    head = Head(["run", "--cluster", cluster, "--run-dir", str(runs), "hog.py", str(go)],
                cwd=tmp_path)
    try:
        no_leftovers.append(job_id_when_started(runs))
        (group / "memory.limit_in_bytes").write_text(str(64 << 20))
        head.wait_for("waits", timeout=120)
        pid = next(int(m.group(1)) for line in head.lines
                   if (m := re.search(r"\] pid (\d+) waits", line)))
        (group / "cgroup.procs").write_text(str(pid))
        go.write_text("")
        assert head.wait(timeout=120) == 1, head.output()
    finally:
        if head.proc.poll() is None:
            head.kill()
        for left in (group / "cgroup.procs").read_text().split():
            (MEMORY_V1 / "cgroup.procs").write_text(left)
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    _, summary = only_run(runs)
    rc = summary["root_cause"]
    node = testbed.nodes[1].name
    assert rc["kind"] == "oom" and rc["rank"] == 1 and rc["host"] == node, rc
    (victim,) = rc["facts"]["oom"]["victims"]
    assert victim["pid"] == pid and victim["main"] and victim["rss"] > 32 << 20
    assert rc["code"] == "run.oom-killed-group", rc
    assert rc["fields"]["victim"].startswith(f"pid {pid}, python, "), rc
    assert rc["fields"]["room"] == f"its memory group /{group.name} hit its limit", rc
    assert any(line.startswith(f"Root cause (first observed failure): rank 1 on {node}: "
                               "killed by the kernel's out-of-memory killer") for line in
               head.err), head.output()
