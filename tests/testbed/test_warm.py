"""``run --warm`` on the namespace testbed: a 2+1+1 job whose ranks come from each node's own
pool (the nodes share /tmp, not their namespaces: each node gets its own pool) gives the ranks,
hosts and all-reduce a cold run gives, twice; ``ps`` lists a pool per node; ``warm stop``
leaves no pool on any node. A node's pool lost between ``ready`` and ``go``: the attempt again,
all cold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.head import Head, only_run, run_head
from tests.testbed.test_run import RANKS

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
POOL_MARK = b"ptcluster-pool"
"""In every pool's (and pooled rank's) command line: ``warm.protocol.POOL_BOOT``."""


@pytest.fixture(scope="module")
def testbed():
    """3 namespace nodes for the module (torn down even on failure)."""
    from tests.support.testbed import Testbed, available, bring_up

    bed = bring_up("multi-node testbed", available(), lambda: Testbed(3))
    try:
        yield bed
    finally:
        bed.close()


def pool_processes() -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if POOL_MARK in f.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def test_warm_ranks_on_three_nodes_equal_cold_ones(testbed, tmp_path, no_leftovers) -> None:
    (tmp_path / "ranks.py").write_text(RANKS)
    cluster = testbed.write_cluster(tmp_path, (2, 1, 1), python=sys.executable)
    before = set(pool_processes())
    seen = {}
    try:
        for how in ("cold", "warm", "warm-again"):
            out = tmp_path / how
            out.mkdir()
            flags = ["--warm", "--warm-idle", "300"] if how != "cold" else []
            code, head = run_head(["run", "--cluster", cluster, "--run-dir", f"runs-{how}",
                                   *flags, "ranks.py", str(out)], cwd=tmp_path)
            job_id, summary = only_run(tmp_path / f"runs-{how}")
            no_leftovers.append(job_id)
            assert code == 0, head.output()
            (attempt,) = summary["attempts"]  # (every node's ranks from its pool, or none)
            assert set(attempt["warm"].values()) == {how != "cold"}, head.output()
            seen[how] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        assert seen["warm"] == seen["cold"] == seen["warm-again"]
        assert [i["host"] for i in seen["warm"]] == [testbed.nodes[i].name for i in (0, 0, 1, 2)]
        listed = subprocess.run([sys.executable, "-m", "ptcluster", "ps", "--json", "--cluster",
                                 cluster], cwd=tmp_path, capture_output=True, text=True,
                                timeout=120)
        pools = json.loads(listed.stdout)["pools"]
        assert sorted(p["node"] for p in pools) == sorted(n.name for n in testbed.nodes)
        assert len({p["pid"] for p in pools}) == 3  # a pool per node, though /tmp is one
    finally:
        stop = subprocess.run([sys.executable, "-m", "ptcluster", "warm", "stop", "--cluster",
                               cluster], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
    assert stop.returncode == 0 and stop.stdout.count("ended") == 3, stop
    deadline = time.monotonic() + 10
    while set(pool_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(pool_processes()) - before


SLOW_IMPORT = "import time\ntime.sleep(8)\n"
"""A ``warm_imports`` module: a new pool says ready 8 s later (its guard's ``ready`` with it)."""


def test_a_pool_lost_between_ready_and_go_launches_the_attempt_again_cold(
        testbed, tmp_path, no_leftovers) -> None:
    """Node 0's pool dies (SIGKILL by its pid, as a crash would) while its guard holds it for
    the ranks, its ``ready`` said, and node 2's guard still waits for a new pool (its warm
    import takes 8 s: no ``go`` yet): at the ``go`` (warm: every node has a pool) node 0's
    guard refuses, ``guard.pool-lost`` (nodes 1 and 2 forked theirs: a cold start there would
    never meet them), and the runner launches the attempt again with every node's ranks cold,
    not counted as a restart: exit 0, the ranks' all-reduce right, no process left."""
    (tmp_path / "ranks.py").write_text(RANKS)
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "slow_warm_mod.py").write_text(SLOW_IMPORT)
    extra = f"warm_imports: [slow_warm_mod]\nenv: {{PYTHONPATH: {mods}}}\n"
    warm = ["--warm", "--warm-idle", "300"]
    first, second = (testbed.nodes[i] for i in (0, 2))
    before = set(pool_processes())
    try:
        # nodes 0 and 1 get their pools (of the same key), node 2 none
        two = testbed.write_cluster(tmp_path, (1, 1), python=sys.executable, extra=extra)
        (tmp_path / "out0").mkdir()
        code, head = run_head(["run", "--cluster", two, "--run-dir", "runs0", *warm, "ranks.py",
                               str(tmp_path / "out0")], cwd=tmp_path)
        no_leftovers.append(only_run(tmp_path / "runs0")[0])
        assert code == 0, head.output()
        (tmp_path / "out").mkdir()
        three = testbed.write_cluster(tmp_path, (2, 1, 1), python=sys.executable, extra=extra)
        head = Head(["run", "--cluster", three, "--run-dir", "runs", *warm, "ranks.py",
                     str(tmp_path / "out")], tmp_path)
        try:
            pid = held_pool(first, lambda: not pool_records(second), within=60)
            os.kill(pid, signal.SIGKILL)
            code = head.wait(300)
        finally:
            if head.proc.poll() is None:
                head.kill()
        job_id, summary = only_run(tmp_path / "runs")
        no_leftovers.append(job_id)
        said = head.output()
        assert code == 0, said
        assert f"{first.name}: its warm pool failed at the fork" in said
        assert f"{first.name}: this node's warm pool could not fork its ranks" in said
        (attempt,) = summary["attempts"]  # (the pooled try: not counted, as an attempt)
        assert set(attempt["warm"].values()) == {False}, summary["attempts"]
        (cold,) = summary["went_cold"]  # (but said: why every node's ranks started cold)
        assert (cold["host"], cold["code"]) == (first.name, "guard.pool-lost"), cold
        sums = {json.loads((tmp_path / "out" / f"rank{r}.json").read_text())["sum"]
                for r in range(4)}
        assert sums == {10.0}
    finally:
        subprocess.run([sys.executable, "-m", "ptcluster", "warm", "stop", "--cluster",
                        testbed.write_cluster(tmp_path, (1, 1, 1), python=sys.executable)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
        deadline = time.monotonic() + 10
        while set(pool_processes()) - before and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not set(pool_processes()) - before


def pool_records(node) -> list[dict]:
    """The records of the pools in ``node``'s namespaces (the nodes share /tmp, where a guard
    that no login gave a runtime directory keeps them: ``guard.tmpdirs.user_tmp``)."""
    net = f"net:{os.stat(f'/run/netns/{node.netns}').st_ino},"
    found = []
    for path in Path(f"/tmp/ptcluster-{os.getuid()}/warm").glob("pool-*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # (one being replaced)
            continue
        if str(record.get("place", "")).startswith(net):
            found.append(record)
    return found


def held_pool(node, still: Callable[[], bool], within: float) -> int:
    """The pid of ``node``'s pool once a guard holds it with no rank forked yet (its record:
    not idle, no rank), checked while ``still()`` holds (no ``go`` can have come)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for record in pool_records(node):
            if record.get("idle_since") is None and record.get("ranks") == 0:
                assert still(), "the go may have come already"
                return int(record["pid"])
        time.sleep(0.05)
    raise AssertionError(f"no pool of {node.name} held by a guard in {within} s")
