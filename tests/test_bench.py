"""`ptcluster bench`: the nccl-tests formulas, and real sweeps on the local cluster."""

from __future__ import annotations

import json

import pytest

from ptcluster.bench.formulas import bandwidths, bus_factor, count_for, parse_size, size_for, sizes
from ptcluster.errors import UsageError
from tests.jobs import run_head


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
                           "-f", "8", "-n", "3", "-w", "1", "--json", "out.json",
                           "--plot", "busbw.png"], cwd=tmp_path, timeout=180)
    assert code == 0, head.output()
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo" and data["out_of_bounds"] == 0
    ops = [r["op"] for r in data["rows"]]
    assert set(ops) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv"}
    assert [r["size"] for r in data["rows"] if r["op"] == "all_reduce"] == [8, 64, 512, 4096,
                                                                           32768]
    check_rows(data["rows"], 2)
    text = "\n".join(head.lines)
    assert "# Out of bounds values : 0 OK" in text and "# Avg bus bandwidth" in text
    png = (tmp_path / "busbw.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    import matplotlib.image

    img = matplotlib.image.imread(tmp_path / "busbw.png")
    assert img.shape[0] > 100 and img.shape[1] > 100


@pytest.mark.slow
def test_wrong_counts_real_mismatches_and_gates(tmp_path) -> None:
    code, head = run_head(["bench", "--nproc", "2", "-b", "1K", "-e", "4K", "-n", "2", "-w", "0",
                           "--json", "out.json", "--corrupt-check"], cwd=tmp_path, timeout=120)
    data = json.loads((tmp_path / "out.json").read_text())
    assert code == 1
    assert [r["wrong"] for r in data["rows"]] == [1, 1, 1]  # one perturbed element per size
    assert "# Out of bounds values : 3 FAILED" in "\n".join(head.lines)
    code, head = run_head(["bench", "--nproc", "2", "-b", "1K", "-e", "1K", "-n", "2", "-w", "0",
                           "--min-busbw", "1000000"], cwd=tmp_path, timeout=120)
    assert code == 1 and "below --min-busbw" in "\n".join(head.err)
