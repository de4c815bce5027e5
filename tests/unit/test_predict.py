"""`bench --predict`'s model, pure: the table from a given compute time, buckets and busbw; the
probe's record read back; the sentences; the job after `--`; the JSON shape and the plot."""

from __future__ import annotations

import pytest

from ptcluster.bench.predict import (
    NETWORK_SHARE,
    PAYS_OFF,
    Bucket,
    BusBw,
    Measured,
    allreduce_s,
    exposed,
    link,
    link_for,
    measured_from,
    predict,
    slower,
    verdict,
)
from ptcluster.bench.probe import Prediction, sweep_sizes
from ptcluster.cli.predict_view import job_target
from ptcluster.errors import UsageError
from ptcluster.remote.rank_records import predict_record
from ptcluster.remote.replies import BadReply

MB = 1_000_000
LINK_100M = BusBw(((1, 0.0125),))
"""100 Mbit/s: 12.5 MB/s of bus bandwidth at every size."""


def one_bucket(step: float = 0.1, nbytes: int = 21 * MB, ready: float = 0.08,
               ranks: int = 1) -> Measured:
    return Measured(step_s=step, exposed_s=0.0, batch=8, ranks=ranks,
                    buckets=(Bucket(nbytes, ready),))


def test_allreduce_time_is_the_rings_traffic_over_busbw() -> None:
    bw = BusBw(((1, 1.0),))
    assert allreduce_s(10 * MB, 1, bw) == 0.0
    assert allreduce_s(10 * MB, 2, bw) == pytest.approx(0.010)  # 2(n-1)/n = 1
    assert allreduce_s(10 * MB, 4, bw) == pytest.approx(0.015)  # 1.5
    assert allreduce_s(10 * MB, 8, bw) == pytest.approx(0.0175)


def test_busbw_interpolates_log_log_and_clamps() -> None:
    bw = BusBw(((1000, 0.1), (100_000, 10.0)))
    assert bw.at(10_000) == pytest.approx(1.0)  # the geometric midpoint
    assert bw.at(1) == 0.1 and bw.at(10**9) == 10.0
    assert bw.scaled(2).at(10_000) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        BusBw(((1000, 0.0),))


def test_a_big_gradient_on_a_slow_link_is_slower_on_more_nodes() -> None:
    m = one_bucket()
    rows = predict(m, [1, 1, 1], LINK_100M)
    assert [r.ranks for r in rows] == [1, 2, 3]
    assert rows[0].step_s == 0.1 and rows[0].efficiency == 1.0 and rows[0].bound == "compute"
    # 21 MB over 12.5 MB/s: 1.68 s on 2 ranks (x1), 2.24 s on 3 (x4/3), all after the one
    # bucket was ready: the step waits for it, then runs the rest of its compute
    assert rows[1].allreduce_s == pytest.approx(1.68)
    assert rows[1].step_s == pytest.approx(0.1 + 1.68)
    assert rows[2].step_s == pytest.approx(0.1 + 2.24)
    assert rows[1].samples_per_s == pytest.approx(8 * 2 / rows[1].step_s)
    assert rows[1].efficiency == pytest.approx(0.1 / rows[1].step_s)
    assert [r.bound for r in rows[1:]] == ["network", "network"]
    assert [(r.nodes, best.nodes) for r, best in slower(rows)] == [(2, 1), (3, 1)]
    now, needed = link(m, [1, 1, 1], LINK_100M)
    assert now == pytest.approx(0.1) and needed is not None and needed > now  # (Gbit/s)
    said = verdict(m, rows, [1, 1, 1], LINK_100M)
    assert said[0].startswith("2 nodes are predicted slower than 1:")
    assert said[1].startswith("3 nodes are predicted slower than 1:")  # faster than 2
    assert "21.00 MB" in said[0]
    assert said[-1].startswith(f"3 nodes would reach {PAYS_OFF:.0%} scaling efficiency")


def test_communication_hidden_behind_backward_costs_nothing() -> None:
    # two buckets, the first ready early: its all-reduce ends before the second is ready
    m = Measured(step_s=1.0, exposed_s=0.0, batch=32, ranks=1,
                 buckets=(Bucket(1 * MB, 0.2), Bucket(1 * MB, 0.9)))
    bw = BusBw(((1, 1.0),))  # 1 GB/s: 1 ms a bucket on 2 ranks
    total, hidden_not = exposed(m.buckets, 2, bw)
    assert total == pytest.approx(0.002)
    assert hidden_not == pytest.approx(0.001)  # only the last bucket's
    rows = predict(m, [1, 1], bw)
    assert rows[1].bound == "compute"
    assert rows[1].efficiency == pytest.approx(1 / 1.001)
    assert verdict(m, rows, [1, 1], bw) == ["2 nodes pay off: 2.00x the samples/s of one node "
                                            "(100% scaling efficiency)."]


def test_buckets_queue_behind_each_other() -> None:
    # both ready at once at the end: back to back, all exposed
    buckets = (Bucket(10 * MB, 0.5), Bucket(10 * MB, 0.5))
    assert exposed(buckets, 2, BusBw(((1, 1.0),))) == pytest.approx((0.02, 0.02))
    # the first ready early but slower than the gap: the second waits for it
    buckets = (Bucket(10 * MB, 0.0), Bucket(10 * MB, 0.005))
    assert exposed(buckets, 2, BusBw(((1, 1.0),)))[1] == pytest.approx(0.015)


def test_the_one_node_runs_own_allreduce_is_taken_out_of_compute() -> None:
    m = Measured(step_s=0.2, exposed_s=0.05, batch=16, ranks=2,
                 buckets=(Bucket(MB, 0.1),))
    rows = predict(m, [2, 2], BusBw(((1, 1.0),)))
    assert rows[0].step_s == 0.2 and rows[0].ranks == 2
    # compute 0.15; 4 ranks: 1 MB x 1.5 / 1 GB/s = 1.5 ms after the bucket was ready
    assert rows[1].step_s == pytest.approx(0.15 + 0.0015)
    assert rows[1].samples_per_s == pytest.approx(16 * 4 / (0.15 + 0.0015))
    assert rows[0].bound == "network"  # 0.05 of 0.2 s > NETWORK_SHARE
    assert NETWORK_SHARE < 0.25


def test_slots_differ_per_node() -> None:
    rows = predict(one_bucket(ranks=2), [2, 1, 4], BusBw(((1, 100.0),)))
    assert [r.ranks for r in rows] == [2, 3, 7]


def test_link_for_reaches_the_target_efficiency() -> None:
    m = one_bucket()
    factor = link_for(m, [1, 1, 1], LINK_100M)
    assert factor is not None and factor > 1
    eff = predict(m, [1, 1, 1], LINK_100M.scaled(factor))[-1].efficiency
    assert eff == pytest.approx(PAYS_OFF, abs=0.005)
    assert link_for(m, [1, 1, 1], BusBw(((1, 1e6),))) == 1.0


def test_one_node_cluster_has_one_row_and_nothing_to_say() -> None:
    m = one_bucket()
    rows = predict(m, [1], None)
    assert len(rows) == 1 and verdict(m, rows, [1], None) == []
    with pytest.raises(ValueError, match="busbw"):
        predict(m, [1, 1], None)


def test_measured_validates() -> None:
    for bad in ({"step_s": 0.0}, {"batch": 0}, {"exposed_s": 0.2}):
        fields = {"step_s": 0.1, "exposed_s": 0.0, "batch": 8, "ranks": 1, "buckets": ()} | bad
        with pytest.raises(ValueError):
            Measured(**fields)


def test_the_probes_record_is_read_back() -> None:
    step = {"step_s": 0.1, "batch": 64, "ddp": True,
            "buckets": [[4_000_000, 0.05, 0.07], [1_048_576, 0.08, 0.09]]}
    odd = dict(step, step_s=0.5, batch=180, eval=True)  # a step with an evaluation in it
    m = measured_from([step, step, odd, dict(step, step_s=0.13)], world_size=2)
    assert m.step_s == pytest.approx(0.11)  # the mean of the training steps
    assert m.batch == 64
    assert m.ranks == 2
    assert m.buckets == (Bucket(4_000_000, 0.05), Bucket(1_048_576, 0.08))
    assert m.exposed_s == pytest.approx(0.01)  # last done 0.09 - last ready 0.08
    assert measured_from([step], 2, batch=5).batch == 5
    with pytest.raises(ValueError):
        measured_from([], 1)
    with pytest.raises(ValueError, match="--batch"):
        measured_from([dict(step, batch=0)], 1)


def test_the_predict_record_is_checked_before_it_is_read() -> None:
    """``remote.rank_records.predict_record``: a record as the step probe writes it passes; one
    whose step time is not a number or whose bucket is not [bytes, ready_s, done_s] is refused,
    named by where."""
    step = {"step_s": 0.1, "batch": 64, "eval": False, "ddp": True,
            "buckets": [[4_000_000, 0.05, 0.07]]}
    record = {"kind": "predict", "world_size": 2, "steps": [step, dict(step, buckets=None)]}
    assert predict_record(record) == record
    for where, bad in (("steps[0].step_s", dict(step, step_s="0.1")),
                       ("steps[0].buckets[0]", dict(step, buckets=[[4_000_000, 0.05]]))):
        with pytest.raises(BadReply) as refused:
            predict_record(dict(record, steps=[bad]))
        assert refused.value.problem.code == "node.record-refused"
        assert refused.value.problem.fields["where"] == f"the predict record.{where}"


def test_sweep_sizes_are_the_buckets_or_a_ladder() -> None:
    assert sweep_sizes([5, 1 << 20, 1 << 20, 25 << 20]) == (5, 1 << 20, 25 << 20)
    many = sweep_sizes([1000 * i for i in range(1, 40)])
    assert len(many) <= 8 and many[0] == 1000 and many[-1] == 39_000


def test_json_rows_have_the_documented_keys() -> None:
    m = one_bucket()
    out = Prediction(measured=m, rows=predict(m, [1, 1], LINK_100M)).to_json()
    assert [set(r) for r in out["rows"]] == [{"nodes", "ranks", "step_s", "samples_per_s",
                                              "efficiency", "bound"}] * 2
    assert "sweep" in out and out["measured"]["grad_bytes"] == 21 * MB


def test_the_job_after_the_double_dash() -> None:
    t = job_target(("-m", "ptcluster.examples.mnist", "--epochs", "1"))
    assert (t.module, t.args) == ("ptcluster.examples.mnist", ("--epochs", "1"))
    assert job_target(("-mpkg.train",)).module == "pkg.train"
    t = job_target(("train.py", "-m", "x"))
    assert (t.script, t.args) == ("train.py", ("-m", "x"))
    for bad in ((), ("-m",), ("--epochs", "1")):
        with pytest.raises(UsageError):
            job_target(bad)


@pytest.mark.parametrize("args,says", [
    (["--predict", "--pairs", "--", "-m", "x"], "--pairs has no meaning with --predict"),
    (["--predict", "-e", "1M", "--", "-m", "x"], "--maxbytes has no meaning with --predict"),
    (["--predict"], "--predict needs the job"),
    (["-m", "x"], "No such option"),
    (["--", "-m", "x"], "a job after -- is for --predict"),
])
def test_bench_refuses_what_predict_cannot_use(args: list[str], says: str) -> None:
    from click.testing import CliRunner

    from ptcluster.cli import cli

    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code != 0
    assert says in result.output + str(result.exception), result.output
