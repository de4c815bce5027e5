"""`ptcluster bench` on the local cluster: real sweeps over every op, a real mismatch, the gate."""

from __future__ import annotations

import json

import pytest

from ptcluster.bench.formulas import (
    bus_factor,
    size_for,
)
from ptcluster.bench.sweep import BenchConfig, run_bench
from ptcluster.cluster.load import local_cluster
from tests.support.head import run_head
from tests.support.sweeps import footer


def check_rows(rows: list[dict], n: int) -> None:
    for r in rows:
        algbw = r["size"] / (r["time_us"] / 1e6) / 1e9
        assert r["algbw"] == pytest.approx(algbw, rel=1e-6)
        assert r["busbw"] == pytest.approx(algbw * bus_factor(r["op"], n), rel=1e-6)
        assert r["size"] == size_for(r["op"], r["count"], n, 4)
        assert r["wrong"] == 0


@pytest.mark.slow
def test_local_bench_all_ops_json_plot(tmp_path) -> None:
    code, head = run_head(["bench", "--nproc", "2", "--op", "all", "-b", "8", "-e", "64K",
                           "-f", "8", "-n", "3", "-w", "1", "-o", "out.json",
                           "--plot", "busbw.png"], cwd=tmp_path, timeout=180)
    assert code == 0, head.output()
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo" and data["out_of_bounds"] == 0
    ops = [r["op"] for r in data["rows"]]
    assert set(ops) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv"}
    assert [r["size"] for r in data["rows"] if r["op"] == "all_reduce"] == [8, 64, 512, 4096,
                                                                           32768]
    check_rows(data["rows"], 2)
    end = footer("\n".join(head.lines))  # (the table's footer, as nccl-tests ends theirs)
    assert end["Out of bounds values"] == "0 OK" and end["Avg bus bandwidth"] == \
        f"{data['avg_busbw']:.4f} GB/s", end
    png = (tmp_path / "busbw.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    import matplotlib.image

    img = matplotlib.image.imread(tmp_path / "busbw.png")
    assert img.shape[0] > 100 and img.shape[1] > 100


@pytest.mark.slow
def test_wrong_counts_real_mismatches(tmp_path, monkeypatch) -> None:
    """Through the library only (BenchConfig.corrupt has no CLI option): on real ranks, rank 0
    expects one wrong value per check, and #wrong, summed over ranks, counts exactly those."""
    monkeypatch.chdir(tmp_path)  # the local cluster's workdir
    cfg = BenchConfig(ops=("all_reduce", "all_gather"), sizes=(1024, 2048, 4096), iters=2,
                      warmup=0, check=2, timeout=120, corrupt=True)
    result = run_bench(local_cluster(2), cfg)
    assert result.failure is None
    assert [(r.op, r.wrong) for r in result.rows] == [(op, 2) for op in cfg.ops for _ in
                                                      cfg.sizes]  # 2 checks x 1 element
    assert result.wrong == 12 and result.to_json()["out_of_bounds"] == 12
    clean = run_bench(local_cluster(2), BenchConfig(ops=("all_reduce",), sizes=(1024,),
                                                    iters=2, warmup=0, timeout=120))
    assert clean.failure is None and [r.wrong for r in clean.rows] == [0]


def test_a_quick_size_is_timed_for_min_s(tmp_path) -> None:
    """The worker's timing on a real (one-rank gloo) group: ``iters`` runs that took less than
    ``min_s`` are followed by as many as should last ``min_s``, timed anew (``bench --predict``:
    five all-reduces of the reference trainer's 0.4 MB bucket took 3.1 ms each in one run and
    11.5 ms in the next on the CPU-capped testbed, one quota period's free part or a throttled
    stretch); without ``min_s``, ``iters`` runs as before."""
    import time

    import torch
    import torch.distributed as dist

    from ptcluster.node.rank.bench_worker import MAX_ITERS, Rank, time_op

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        me = Rank(0, 1, torch.device("cpu"), torch.float32)
        calls: list[float] = []

        def run() -> None:
            calls.append(time.perf_counter())

        assert time_op(me, run, 1, 2) > 0 and len(calls) == 3  # warm-up, iters
        calls.clear()
        seconds = time_op(me, run, 1, 2, min_s=1.0)
        # two appends take far less than a second: timed again, as many as make 1 s (capped)
        assert 3 < len(calls) <= 3 + MAX_ITERS
        assert seconds == pytest.approx((calls[-1] - calls[3]) / (len(calls) - 4), rel=0.5,
                                        abs=1e-4)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_min_busbw_gates(tmp_path) -> None:
    """A real sweep under the gate: its measure is below, so it fails (the code and fields of
    the refusal: unit test_bench), and the measure it failed by is the data it printed."""
    code, head = run_head(["bench", "--nproc", "2", "-b", "1K", "-e", "1K", "-n", "2", "-w", "0",
                           "--json", "--min-busbw", "1000000"], cwd=tmp_path, timeout=120)
    got = json.loads("\n".join(head.lines))
    assert code == 1 and 0 < got["avg_busbw"] < 1e6 and got["failure"] is None, head.err


@pytest.mark.parametrize(("gbps", "slowest", "ratio", "slow"), [
    ([10.0, 10.0, 10.0], ("n0", "n1"), 1.0, False),  # a tie: the first, within range
    ([10.0, 9.0, 11.0], ("n0", "n2"), 0.9, False),
    ([10.0, 10.0, 6.0, 10.0, 10.0, 10.0], ("n0", "n3"), 0.6, True),  # one bad link of 4 nodes
    ([2.0, 10.0, 10.0, 10.0], ("n0", "n1"), 0.2, True),  # an even count: the middle two
])
def test_the_slowest_pair_is_named_against_the_median(gbps, slowest, ratio, slow) -> None:
    from ptcluster.bench.sweep import slowest_pair

    hosts = [f"n{i}" for i in range(4)]
    links = [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1:]][:len(gbps)]
    pairs = [{"a": a, "b": b, "bytes": 1, "gbps": g} for (a, b), g in zip(links, gbps, strict=True)]
    found = slowest_pair(pairs)
    assert found is not None and (found.a, found.b) == slowest
    assert found.ratio == pytest.approx(ratio) and found.slow is slow
    assert ("slow: below" in found.line()) is slow and found.to_json()["slow"] is slow
