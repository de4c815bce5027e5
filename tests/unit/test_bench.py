"""`ptcluster bench` without a job: the nccl-tests formulas, its config, the plots' ticks, and the
CLI on a recorded sweep (the plots themselves: ``tests/local/test_bench_plots.py``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ptcluster.bench.formulas import (
    OPS,
    bandwidths,
    bus_factor,
    count_for,
    parse_size,
    size_for,
    sizes,
)
from ptcluster.bench.plot import (
    number_label,
    size_label,
    size_ticks,
    time_ticks,
)
from ptcluster.bench.sweep import BenchConfig, BenchResult, Row, worker_config
from ptcluster.errors import UsageError
from ptcluster.remote.rank_records import pair_done, row_done, started
from ptcluster.remote.replies import BadReply
from tests.support.sweeps import footer, sweep_result


@pytest.mark.parametrize("op,n,factor", [
    ("all_reduce", 1, 0.0), ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5),
    ("all_reduce", 8, 1.75), ("all_gather", 2, 0.5), ("all_gather", 4, 0.75),
    ("all_gather", 8, 0.875), ("reduce_scatter", 4, 0.75), ("reduce_scatter", 16, 0.9375),
    ("broadcast", 8, 1.0), ("sendrecv", 2, 1.0), ("sendrecv", 16, 1.0),
])
def test_bus_factor_matches_nccl_tests(op: str, n: int, factor: float) -> None:
    assert bus_factor(op, n) == pytest.approx(factor)


def test_bandwidths_and_sizes() -> None:
    # 1 GB in 0.5 s on 4 ranks: algbw 2 GB/s; all_reduce busbw 2 x 2*3/4 = 3 GB/s
    assert bandwidths("all_reduce", 10**9, 0.5, 4) == pytest.approx((2.0, 3.0))
    assert bandwidths("all_gather", 10**9, 0.5, 4) == pytest.approx((2.0, 1.5))
    assert bandwidths("broadcast", 10**9, 1.0, 4) == pytest.approx((1.0, 1.0))
    # all_gather/reduce_scatter sizes are totals over ranks; counts are per rank
    assert count_for("all_gather", 1024, 4, 4) == 64
    assert size_for("all_gather", 64, 4, 4) == 1024
    assert count_for("all_reduce", 1024, 4, 4) == 256
    assert count_for("reduce_scatter", 8, 4, 4) == 0  # too small: skipped like nccl-tests


def test_the_worker_gets_the_heads_counts() -> None:
    """The counts the ranks run are count_for's (the worker has no formula of its own)."""
    cfg = BenchConfig(ops=OPS, sizes=(8, 1024, 4096), dtype="float16", pair_size=3)
    wc = worker_config(cfg, 4, [[0, 2]])
    assert wc["plan"] == [(op, [c for c in (count_for(op, s, 4, 2) for s in cfg.sizes) if c])
                          for op in OPS]
    assert dict(wc["plan"])["all_gather"] == [1, 128, 512]  # 8 B / (2 B x 4 ranks) = 1
    assert dict(wc["plan"])["all_reduce"] == [4, 512, 2048]
    assert wc["pairs"] == [] and wc["pair_count"] == 1 and wc["corrupt"] is False
    assert wc["min_s"] == 0.0 and worker_config(replace(cfg, min_s=1.0), 4, [])["min_s"] == 1.0
    assert worker_config(BenchConfig(ops=OPS, sizes=(8,), pairs=True), 4, [[0, 2]])["pairs"] == [
        [0, 2]]
    one_rank = worker_config(BenchConfig(ops=("all_reduce", "sendrecv"), sizes=(8,)), 1, [])
    assert one_rank["plan"] == [("all_reduce", [2])]  # sendrecv needs 2 ranks: not shipped
    json.dumps(wc)  # it travels as argv JSON


def test_the_workers_records_are_checked_before_they_are_read() -> None:
    """``remote.rank_records``: the worker's records as it writes them pass; a count that is
    text, a pair without its peer or a key the worker does not write is refused, named."""
    row = {"op": "all_reduce", "count": 512, "seconds": 1e-4, "wrong": 0}
    assert row_done(row) == row
    assert started({"world_size": 4, "backend": "gloo", "device": "cpu"})["backend"] == "gloo"
    assert pair_done({"a": 0, "b": 2, "seconds": 0.01})["b"] == 2
    for check, bad, where in ((row_done, dict(row, count="512"), "the bench's row.count"),
                              (pair_done, {"a": 0, "seconds": 0.01}, "the bench's pair.b"),
                              (row_done, dict(row, extra=1), "the bench's row")):
        with pytest.raises(BadReply) as refused:
            check(bad)
        assert refused.value.problem.code == "node.record-refused"
        assert refused.value.problem.fields["where"] == where


@pytest.mark.parametrize("field,value,message", [
    ("iters", 0, "iters must be >= 1"), ("warmup", -1, "warmup must be >= 0"),
    ("check", -1, "check must be >= 0"), ("pair_size", 0, "pair_size must be >= 1"),
    ("sizes", (), "sizes must be one or more"), ("sizes", (8, 0), "sizes must be one or more"),
    ("ops", ("all_reduce", "nope"), "ops must be one or more of all_reduce"),
    ("ops", (), "ops must be one or more"), ("timeout", 0.0, "timeout must be"),
    ("timeout", float("nan"), "timeout must be"), ("timeout", float("inf"), "timeout must be"),
    ("dtype", "int8", "dtype must be one of"), ("min_s", -1.0, "min_s must be"),
    ("min_s", float("inf"), "min_s must be"), ("min_s", float("nan"), "min_s must be"),
])
def test_bench_config_rejects_bad_values(field: str, value: object, message: str) -> None:
    kwargs: dict = {"ops": ("all_reduce",), "sizes": (8,), field: value}
    with pytest.raises(ValueError, match=message):
        BenchConfig(**kwargs)


def test_bench_config_accepts_the_edges() -> None:
    cfg = BenchConfig(ops=OPS, sizes=(1,), iters=1, warmup=0, check=0, pair_size=1,
                      timeout=0.5)
    assert cfg.sizes == (1,)


@pytest.mark.parametrize("text,value", [("8", 8), ("64K", 65536), ("64M", 64 << 20),
                                        ("1G", 1 << 30), ("4k", 4096), ("16MB", 16 << 20)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_size_series_and_errors() -> None:
    assert sizes(8, 128, factor=2) == [8, 16, 32, 64, 128]
    assert sizes(8, 100, factor=4) == [8, 32]
    assert sizes(100, 400, step=100) == [100, 200, 300, 400]
    for bad in (lambda: sizes(64, 8), lambda: sizes(8, 64, factor=1), lambda: parse_size("x")):
        with pytest.raises(UsageError):
            bad()


def fake_result(wrong: int = 0) -> BenchResult:
    size, seconds = 1024, 1e-4
    algbw, busbw = bandwidths("all_reduce", size, seconds, 2)
    return BenchResult(world_size=2, backend="gloo", rows=[Row(
        op="all_reduce", size=size, count=256, type="float32", redop="sum", root=-1,
        time_us=seconds * 1e6, algbw=algbw, busbw=busbw, wrong=wrong)])


class FakeBench(list[BenchConfig]):
    """The configs the CLI passed, in order; ``wrong``: the wrong elements of the result."""

    wrong = 0


@pytest.fixture
def fake_bench(monkeypatch) -> FakeBench:
    """`ptcluster bench` with the sweep replaced by a fixed result: the CLI's own behaviour."""
    import ptcluster.cli.bench_cmd as bench_cmd

    seen = FakeBench()

    def run_bench(spec: object, cfg: BenchConfig, port: int | None = None) -> BenchResult:
        seen.append(cfg)
        return fake_result(wrong=seen.wrong)

    monkeypatch.setattr(bench_cmd, "run_bench", run_bench)
    return seen


def test_bench_json_flag_prints_data_only(cli, fake_bench) -> None:
    code, out, err = cli("bench", "--nproc", "2", "-b", "1K", "-e", "4K", "--json")
    assert code == 0
    assert json.loads(out) == fake_result().to_json()  # nothing but the JSON on stdout
    assert err.splitlines() == [  # the status line goes to stderr
        "ptcluster bench: 2 rank(s) on 1 node(s), all_reduce, 3 size(s)"]
    assert fake_bench[0].sizes == (1024, 2048, 4096)
    code, out, err = cli("-q", "bench", "--nproc", "2", "--json")
    assert code == 0 and json.loads(out) == fake_result().to_json() and err == ""


@pytest.mark.parametrize("flag", ["-o", "--json-out"])
def test_bench_json_out_writes_a_file_and_keeps_the_table(cli, fake_bench, tmp_path,
                                                          flag: str) -> None:
    f = tmp_path / "b.json"
    code, out, _ = cli("bench", "--nproc", "2", flag, str(f))
    assert code == 0 and footer(out)["Avg bus bandwidth"] == \
        f"{fake_result().avg_busbw:.4f} GB/s"  # (the table too)
    assert json.loads(f.read_text()) == fake_result().to_json()
    code, out, _ = cli("bench", "--nproc", "2", "--json", flag, str(f))
    assert code == 0 and json.loads(out) == json.loads(f.read_text())


def test_bench_json_takes_no_file_and_an_unwritable_file_is_one_line(cli, fake_bench,
                                                                     tmp_path) -> None:
    code, out, err = cli("bench", "--nproc", "2", "--json", str(tmp_path / "b.json"))
    assert code == 2 and out == "" and "b.json" in err and "Traceback" not in err
    code, _, err = cli("-q", "bench", "--nproc", "2", "-o", "/proc/x/b.json")
    assert code == 1
    assert err.startswith("error: /proc/x/b.json: ") and "Fix:" in err
    assert len(err.splitlines()) == 1


def test_bench_below_min_busbw_fails_with_the_measure_and_the_gate(cli, fake_bench) -> None:
    avg = fake_result().avg_busbw
    code, out, err = cli("-q", "bench", "--nproc", "2", "--json", "--min-busbw", "1e6")
    assert code == 1 and json.loads(out)["avg_busbw"] == avg  # the data comes first
    assert cli.problem.code == "cli.below-min-busbw"
    assert cli.problem.fields == {"avg": f"{avg:.3f}", "min": "1e+06"}
    assert err == (f"error: average bus bandwidth {avg:.3f} GB/s is below --min-busbw 1e+06. "
                   "Fix: find the slow link with `ptcluster bench --pairs`, or lower "
                   "--min-busbw\n")  # the one rendering
    code, _, _ = cli("-q", "bench", "--nproc", "2", "--json", "--min-busbw", f"{avg / 2}")
    assert code == 0 and cli.problem is None


def test_bench_wrong_values_fail_in_table_and_json(cli, fake_bench) -> None:
    fake_bench.wrong = 1
    code, out, _ = cli("bench", "--nproc", "2")
    assert code == 1 and footer(out)["Out of bounds values"] == "1 FAILED"
    code, out, _ = cli("bench", "--nproc", "2", "--json")
    assert code == 1 and json.loads(out)["out_of_bounds"] == 1
    assert not any(cfg.corrupt for cfg in fake_bench)


def test_the_corruption_hook_is_not_a_cli_option(cli, fake_bench) -> None:
    code, _, err = cli("bench", "--nproc", "2", "--corrupt-check")
    assert code == 2 and "--corrupt-check" in err and not fake_bench


@pytest.mark.parametrize("nbytes,label", [
    (8, "8 B"), (1000, "1000 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (3 << 20, "3 MiB"),
    (1 << 30, "1 GiB"), (64 << 30, "64 GiB"), (1 << 40, "1 TiB"),
])
def test_size_label(nbytes: int, label: str) -> None:
    assert size_label(nbytes) == label


@pytest.mark.parametrize("lo,hi,ticks", [
    (8, 64 << 20, [16, 64, 256, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20,
                   4 << 20, 16 << 20, 64 << 20]),  # the default sweep: every 2nd power
    (8, 1 << 30, [1 << e for e in range(4, 31, 2)]),
    (8, 1 << 40, [32, 1 << 10, 32 << 10, 1 << 20, 32 << 20, 1 << 30, 32 << 30, 1 << 40]),
    (1 << 20, 1 << 20, [1 << 20]), (3000, 3000, [3000]),
])
def test_size_ticks_stay_few_and_keep_1024_powers(lo: int, hi: int, ticks: list[int]) -> None:
    assert size_ticks(lo, hi) == ticks


def test_time_ticks_are_round_and_few() -> None:
    assert time_ticks(15, 900) == [20, 50, 100, 200, 500]
    assert time_ticks(10, 10**7) == [10.0**e for e in range(1, 8)]
    assert time_ticks(610, 790) == [700]
    assert [number_label(t) for t in (20, 1500, 10**6, 0.5)] == ["20", "1,500", "1,000,000",
                                                                 "0.5"]


def test_no_slowest_pair_from_fewer_than_three_pairs() -> None:
    from ptcluster.bench.sweep import slowest_pair

    result = sweep_result(pairs=False)
    assert slowest_pair([{"a": "x", "b": "y", "bytes": 1, "gbps": 1.0}]) is None
    assert result.to_json()["slowest_pair"] is None


def test_the_table_and_the_json_name_the_same_slowest_pair() -> None:
    from ptcluster.cli.bench_cmd import render

    result = sweep_result(pairs=True)  # node0-node1 20, node0-node2 30, node1-node2 40 GB/s
    data = result.to_json()["slowest_pair"]
    assert data == {"a": "node0", "b": "node1", "gbps": 20.0, "median_gbps": 30.0,
                    "ratio": 0.667, "slow": True}
    text = render(result, BenchConfig(ops=OPS, sizes=(8,), pairs=True))
    said = [line for line in text.splitlines() if line.startswith("# slowest pair:")]
    assert said == [f"# slowest pair: {data['a']} <-> {data['b']} {data['gbps']:.3f} GB/s, "
                    f"median of the pairs {data['median_gbps']:.3f} GB/s ({data['ratio']:.2f}x, "
                    "slow: below 0.7x the median)"], text
