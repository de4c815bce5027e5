"""`ptcluster bench`'s plots drawn from a recorded sweep: here, not in tests/unit/, because
matplotlib may start a process (``fc-list``, to build its font cache on a fresh machine)."""

from __future__ import annotations

from pathlib import Path

from ptcluster.bench.plot import pairs_path, write_plots
from tests.support.sweeps import sweep_result


def assert_png(path, min_px: int) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    img = matplotlib.image.imread(path)
    assert min(img.shape[:2]) >= min_px
    assert img[..., :3].std() > 0.05  # something was drawn, not a blank canvas


def test_plots_without_and_with_pairs(tmp_path) -> None:
    written = write_plots(sweep_result(pairs=False), tmp_path / "b.png")
    assert written == [tmp_path / "b.png"] and not (tmp_path / "b-pairs.png").exists()
    assert_png(tmp_path / "b.png", 700)  # two panels, 10 x 8 in at 100 dpi
    written = write_plots(sweep_result(pairs=True), tmp_path / "c.png")
    assert written == [tmp_path / "c.png", tmp_path / "c-pairs.png"]
    assert_png(tmp_path / "c.png", 700)
    assert_png(tmp_path / "c-pairs.png", 400)
    assert pairs_path("out/F") == Path("out/F-pairs.png")


def test_plot_option_writes_the_pairs_heatmap_next_to_the_plot(cli, monkeypatch,
                                                               tmp_path) -> None:
    import ptcluster.cli.bench_cmd as bench_cmd

    monkeypatch.setattr(bench_cmd, "run_bench", lambda spec, cfg, port=None: sweep_result(
        pairs=cfg.pairs))
    code, _, err = cli("bench", "--nproc", "2", "--pairs", "--plot", str(tmp_path / "F.png"))
    assert code == 0, err
    assert f"plot: {tmp_path / 'F.png'}" in err and f"plot: {tmp_path / 'F-pairs.png'}" in err
    assert_png(tmp_path / "F-pairs.png", 400)
