"""``run --warm`` on the namespace testbed: a 2+1+1 job whose ranks come from each node's own
pool (the nodes share /tmp, not their namespaces: each node gets its own pool) gives the ranks,
hosts and all-reduce a cold run gives, twice; ``ps`` lists a pool per node; ``warm stop``
leaves no pool on any node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support.head import only_run, run_head
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
