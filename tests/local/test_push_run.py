"""``run --data``: the folder pushed before launch, the ranks given its path; a failed push
starts nothing."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support.head import only_run, run_head

pytestmark = pytest.mark.slow

READS = textwrap.dedent("""
    import os, sys
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt"), "w") as f:
        f.write(" ".join([os.environ["PTCLUSTER_DATA"], os.environ["PTCLUSTER_DATA_SHARDS"],
                          open(os.path.join(os.environ["PTCLUSTER_DATA"], "a", "x.txt")).read()]))
""")


def test_run_data_pushes_then_ranks_read_it(tmp_path: Path, no_leftovers) -> None:
    (tmp_path / "reads.py").write_text(READS)
    src = tmp_path / "shards"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.txt").write_text("hello")
    dest = tmp_path / "on-node"
    out = tmp_path / "out"
    out.mkdir()
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "--data",
                           f"{src}={dest}", "reads.py", str(out)], cwd=tmp_path)
    job_id, _ = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    assert (dest / "a" / "x.txt").read_text() == "hello"
    for rank in (0, 1):
        assert (out / f"rank{rank}.txt").read_text() == f"{dest} {dest} hello"
    # what run says of its data before the launch: the push's line (its outcome's figures:
    # push --json, test_push), as it is
    assert f"ptcluster: push: {src} (1 file(s), 0.0 MB) to {dest} on 1 node(s)" in head.err, \
        head.output()


def test_run_data_missing_src_starts_nothing(tmp_path: Path, cli, monkeypatch) -> None:
    (tmp_path / "reads.py").write_text(READS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PTCLUSTER_CLUSTER", raising=False)
    code, _, err = cli("run", "--nproc", "2", "--run-dir", "runs", "--data",
                       str(tmp_path / "absent"), "reads.py", str(tmp_path))
    assert code == 2 and cli.problem.code == "push.src-missing", err
    assert cli.problem.fields == {"src": str(tmp_path / "absent")}
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
