"""ptcluster inside a Slurm allocation on this machine: which cluster file wins."""

from __future__ import annotations

from tests.local.test_cli import exported


def test_cluster_option_wins_inside_an_allocation(cli, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "sl[0-2]")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: asking Slurm would fail
    (tmp_path / "c.yaml").write_text("nodes:\n  - {host: 10.0.0.1, slots: 2}\n")
    code, out, err = cli("env", "--cluster", str(tmp_path / "c.yaml"))
    assert code == 0, err
    assert "using Slurm" not in err and exported(out)["MASTER_ADDR"] == "10.0.0.1"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster.yaml").write_text("nodes:\n  - {host: 10.0.0.1, slots: 2}\n")
    code, out, err = cli("env")  # inside the allocation: Slurm, not ./cluster.yaml
    assert code == 2 and cli.problem.code == "slurm.no-scontrol", err
