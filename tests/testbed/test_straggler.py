"""The straggler report on the 3-node testbed (real sshd, a real DDP job over gloo, 1+1+1
ranks, ``tests/programs/straggler_job.py``): with one node capped to ``CAP_PERCENT`` % of a
CPU, its rank is named, after rank 0's first step and within the first ``WITHIN_SHARE`` of its
steps, the console line the same as summary.json's; a balanced job gets no report."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.support.head import only_run, run_head

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
JOB = Path(__file__).resolve().parents[1] / "programs" / "straggler_job.py"
CAP_PERCENT = 10
"""At 25 % a CI run named the rank at 1.8x with "why unknown" (its main thread slept while its
own communication threads waited for the quota), and beside two busy loops it was named only
after 1365 of 1540 steps: the ratio hovered at the threshold. At 10 %, beside the same two
loops: 6.1x, named in time, its CPU named saturated. A cap well under any share the other ranks
get keeps the test about the report, not about the machine's load."""
WITHIN_SHARE = 0.5
"""The share of rank 0's steps (in its 30 s) before the first report. The report needs a full
window (3 reports of 2 s from every rank, collectives completed in each, so the first is after
the job's start), then 2 evaluations in a row: 8-12 s of the 30 s. A bound in steps alone
depended on the machine's speed: the capped job made ~40 steps/s in one run and 64 in another
(680 steps before a report at 10.6 s)."""


def run_job(testbed, tmp_path: Path, no_leftovers,
            seconds: float) -> tuple[list[str], dict, list[float]]:
    cluster = testbed.write_cluster(tmp_path, [1, 1, 1])
    runs = tmp_path / f"runs-{time.monotonic_ns()}"
    code, head = run_head(["run", "--cluster", str(cluster), "--run-dir", str(runs), str(JOB),
                           "--seconds", str(seconds)], cwd=tmp_path, timeout=300)
    job_id, summary = only_run(runs)
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    steps = [float(m.group(1)) for line in (runs / job_id / "rank0.log").read_text().splitlines()
             if (m := re.search(r"step \d+ t=([\d.]+)", line))]
    return head.err, summary, steps


def test_a_capped_node_is_named_with_its_rank_and_why(testbed, tmp_path, no_leftovers) -> None:
    from tests.support.testbed import cpu_capped

    slow = testbed.nodes[2]
    with cpu_capped(slow, CAP_PERCENT):
        err, summary, steps = run_job(testbed, tmp_path, no_leftovers, seconds=30)
    report = summary["straggler"]
    assert report["history"], report
    first = report["history"][0]
    assert first["ranks"] == [2] and first["host"] == slow.name, report
    assert steps and first["at"] > steps[0], (first, steps[:3])
    before = sum(t < first["at"] for t in steps)
    assert before <= WITHIN_SHARE * len(steps), (before, len(steps), first)
    said = [line for line in err if "straggler" in line]
    assert said and said[0] == f"ptcluster: {first['line']}", err
    assert len(said) == len(report["history"]), (said, report["history"])
    assert said[0].startswith(f"ptcluster: rank 2 on {slow.name} is the straggler: the other "
                              "ranks wait ")
    assert f"its steps take {first['ratio']:.1f}x the median" in said[0]
    assert first["why"] in said[0] and {"cpu_starved", "cpu_throttled"} & set(first["seen"]), \
        first  # (a CPU quota: its main thread waits for a CPU, or the quota throttles it)
    assert first["ratio"] >= report["threshold"]
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert set(ranks) == {0, 1, 2}, report["ranks"]
    assert ranks[2]["host"] == slow.name
    assert all(0 <= r["wait_share_job"] <= 1 for r in ranks.values())
    # the others waited for it: over the whole job the capped rank's main thread slept least
    assert ranks[2]["wait_share_job"] < min(ranks[0]["wait_share_job"],
                                            ranks[1]["wait_share_job"]), ranks


def test_a_balanced_job_gets_no_report(testbed, tmp_path, no_leftovers) -> None:
    err, summary, _ = run_job(testbed, tmp_path, no_leftovers, seconds=20)
    report = summary["straggler"]
    assert report["trace"], report  # it was judged, and judged nobody
    assert report["history"] == [] and report["current"] is None, report
    assert not [line for line in err if "straggler" in line], err
    assert report["peak"] is None or report["peak"]["ratio"] < report["threshold"], report
