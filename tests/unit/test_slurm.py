"""ptcluster and Slurm without a Slurm: the allocation read from Slurm's environment and
`scontrol`'s answers (recorded), the `srun` step's command line, `ended_by` and doctor's Slurm
checks, `submit --dry-run`. The real Slurm is in ``tests/testbed/test_slurm.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ptcluster.cluster.slurm import (
    allocation_from_env,
    describe,
    job_port,
    parse_node_addrs,
    parse_tasks_per_node,
    slurm_cluster,
)
from ptcluster.doctor.node_report import NodeReport
from ptcluster.doctor.slurm_checks import slurm_checks
from ptcluster.remote.slurm import SrunTransport, ended_by_slurm, job_end
from ptcluster.remote.transport import explain_channel_failure, explain_start_failure

PY = sys.executable


@pytest.mark.parametrize(("value", "expected"), [
    ("1(x3)", (1, 1, 1)), ("2,1(x2)", (2, 1, 1)), ("4", (4,)), ("2(x2),3", (2, 2, 3)),
    ("", ()), ("2,x", ()),
])
def test_tasks_per_node(value: str, expected: tuple[int, ...]) -> None:
    assert parse_tasks_per_node(value) == expected


def test_node_addrs_from_scontrol_oneliner() -> None:
    text = ("NodeName=sl0 Arch=x86_64 CoresPerSocket=1  NodeAddr=10.1.0.5 NodeHostName=a "
            "OS=Linux 6.1 #1 SMP\nNodeName=sl1 Arch=x86_64 NodeAddr=gpu-b.ib NodeHostName=b\n")
    assert parse_node_addrs(text) == {"sl0": "10.1.0.5", "sl1": "gpu-b.ib"}


def fake_scontrol(argv: list[str]) -> str:
    if argv[:2] == ["show", "hostnames"]:
        return "sl0\nsl1\nsl2\n"
    return "".join(f"NodeName=sl{i} NodeAddr=10.9.0.{i + 10} NodeHostName=h{i} State=IDLE\n"
                   for i in range(3))


@pytest.mark.parametrize(("env", "nproc", "slots"), [
    ({}, None, [1, 1, 1]),
    ({}, 3, [3, 3, 3]),
    ({"SLURM_GPUS_PER_NODE": "a100:4"}, None, [4, 4, 4]),
    ({"SLURM_GPUS_PER_NODE": "4"}, 2, [2, 2, 2]),
    ({"SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2,1(x2)"}, None, [2, 1, 1]),
    ({"SLURM_TASKS_PER_NODE": "2,1(x2)"}, None, [1, 1, 1]),  # tasks not asked for: Slurm's 1
    ({"SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "1(x3)", "SLURM_GPUS_ON_NODE": "2"}, None,
     [2, 2, 2]),
])
def test_slots_from_nproc_then_gpus_then_tasks(env: dict[str, str], nproc: int | None,
                                                slots: list[int]) -> None:
    alloc = allocation_from_env({"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "sl[0-2]", **env})
    assert alloc is not None
    spec = slurm_cluster(alloc, nproc, scontrol=fake_scontrol)
    assert [n.slots for n in spec.nodes] == slots
    assert [n.host for n in spec.nodes] == ["10.9.0.10", "10.9.0.11", "10.9.0.12"]
    assert [n.slurm_node for n in spec.nodes] == ["sl0", "sl1", "sl2"]
    assert spec.master.addr == "10.9.0.10" and spec.master.port == job_port("1234") == 29734
    assert spec.slurm_job == "1234" and not spec.local
    assert describe(spec).startswith(f"using Slurm job 1234: 3 node(s), {sum(slots)} rank(s)")


def test_ended_by_slurm_only_when_the_job_no_longer_runs() -> None:
    def state(text: str):
        return lambda argv: text
    assert ended_by_slurm("7", state("JobId=7 JobName=x JobState=RUNNING Reason=None")) is None
    why = ended_by_slurm("7", state("JobId=7 JobState=CANCELLED Reason=None Dependency=(null)"))
    assert why is not None and why.startswith("Slurm ended job 7 (JobState=CANCELLED)")
    assert job_end("JobId=7 JobState=PENDING Reason=BeginTime") == ("PENDING", "BeginTime")
    assert job_end("JobId=7 JobState=CANCELLED Reason=None") == ("CANCELLED", None)
    assert job_end("JobId=7 JobState=RUNNING Reason=None") is None


def test_srun_refusing_the_step_is_explained() -> None:
    said = explain_channel_failure(
        ["srun: error: Unable to confirm allocation for job 999: Invalid job id specified"], 1,
        "/venv/bin/python")
    assert said.code == "node.srun-refused" and said.who is None and said.fix
    assert said.fields["detail"].startswith("srun: error: Unable to confirm allocation")
    said = explain_channel_failure(["srun: error: sl0: task 0: Exited with exit code 1"],
                                   1, "/venv/bin/python")
    assert said.code == "node.command-failed"  # a task's own exit: not Slurm's refusal
    said = explain_start_failure("srun", FileNotFoundError(2, "No such file"))
    assert (said.code, said.fields) == ("node.no-srun", {"program": "'srun'",
                                                         "error": "No such file"})
    assert said.what == "cannot start 'srun' here: No such file"  # (one rendering kept)


def test_outside_an_allocation_nothing_changes() -> None:
    assert allocation_from_env({"SLURM_JOB_ID": "5"}) is None
    assert allocation_from_env({}) is None


def test_srun_step_is_one_task_on_one_node_sharing_the_allocation() -> None:
    t = SrunTransport(host="10.9.0.11", node="sl1", job_id="77")
    argv = t.argv(["/venv/bin/python", "-u", "-c", "CODE", "guard", "JOB"])
    assert argv[0] == "srun"
    for opt in ("--jobid=77", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=sl1",
                "--kill-on-bad-exit=1"):
        assert opt in argv
    assert not any(a.startswith(("--gpus-per-task", "--gres", "--exact")) for a in argv)
    assert argv[argv.index("--") + 1:] == ["/venv/bin/python", "-u", "-c", "CODE", "guard", "JOB"]


def test_submit_dry_run_prints_the_script_and_writes_nothing(cli, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("submit", "--nodes", "3", "--gpus-per-node", "2", "--time", "1:00:00",
                         "--partition", "gpu", "--dry-run", "--", "-m",
                         "ptcluster.examples.mnist", "--epochs", "3", "--resume")
    assert code == 0, err
    assert not (tmp_path / "ptcluster-runs").exists()
    sbatch = [line for line in out.splitlines() if line.startswith("#SBATCH")]
    assert sbatch[:3] == ["#SBATCH --job-name=ptcluster", "#SBATCH --nodes=3",
                          "#SBATCH --ntasks-per-node=1"]
    for line in ("#SBATCH --gpus-per-node=2", "#SBATCH --time=1:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --signal=USR2@120", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append", f"#SBATCH --chdir={tmp_path}"):
        assert line in sbatch
    (output,) = [line for line in sbatch if line.startswith("#SBATCH --output=")]
    run_dir = Path(output.split("=", 1)[1]).parent
    assert run_dir.parent == tmp_path / "ptcluster-runs"
    assert out.rstrip().splitlines()[-1] == (
        f"exec {PY} -m ptcluster run --run-dir {run_dir} -m ptcluster.examples.mnist "
        "--epochs 3 --resume")
    code, out, err = cli("submit", "--time", "soon", "--dry-run", "--", "x.py")
    assert code == 2 and cli.problem.code == "submit.not-a-time", err
    assert cli.problem.fields == {"time": "'soon'"}


@pytest.mark.parametrize("name", ["proj\ntouch PWNED #", "proj\rx", "proj\x1bx"])
def test_submit_refuses_a_workdir_with_a_line_break_and_writes_no_script(
        cli, tmp_path, monkeypatch, name: str) -> None:
    """M6: a ``#SBATCH --chdir=`` line ends at the line break whatever the quoting, and the rest
    would be a line of the script, run as the user. Refused (exit 2), in one line that names
    the value and the fix, before anything is written or sbatch is asked."""
    workdir = tmp_path / name
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    for dry in ([], ["--dry-run"]):
        code, out, err = cli("submit", *dry, "--", "x.py")
        assert code == 2, (out, err)
        assert "#SBATCH" not in out and "touch" not in out
        (line,) = [x for x in err.splitlines() if x.strip()]
        assert cli.problem.code == "submit.control-character" and "Fix:" in line, line
        assert cli.problem.fields["what"] == "the working directory"
        assert cli.problem.fields["value"] == repr(str(workdir))
        assert not (workdir / "ptcluster-runs").exists()
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("submit", "--dry-run", "--", "x.py", "a\nb")
    assert code == 2 and "argument" in err


def _doctor(slots: int, slurm: dict, gpus: int = 0) -> list[tuple[str, str, str]]:
    alloc = allocation_from_env({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "sl[0-2]"})
    assert alloc is not None
    spec = slurm_cluster(alloc, slots, scontrol=fake_scontrol)
    facts = {"slurm": slurm, "gpus": {"count": gpus}}
    probes = {n.host: NodeReport(host=n.host, facts=facts) for n in spec.nodes}
    return [(f.check, f.status, f.detail) for f in slurm_checks(spec, probes)
            if f.host == spec.nodes[0].host]


@pytest.mark.parametrize(("slots", "slurm", "gpus", "cpus", "gpu_status", "words"), [
    (2, {"affinity": [0, 1, 2, 3], "cpus_on_node": "4"}, 0, "ok", "ok", "4 CPU(s) for 2 rank"),
    (2, {"affinity": [3], "cpus_on_node": "4"}, 0, "fail", "ok", "2 ranks may use only 1 CPU"),
    (1, {"affinity": [0, 1], "cpus_on_node": "8"}, 0, "warn", "ok", "2 of the 8 CPUs"),
    (4, {"affinity": list(range(8)), "cpus_on_node": "8", "cuda_visible_devices": "2"}, 4, "ok",
     "fail", "4 ranks see 1 GPU(s) (CUDA_VISIBLE_DEVICES=2; 4 on the node)"),
    (4, {"affinity": list(range(8)), "cuda_visible_devices": "0,1,2,3"}, 4, "ok", "ok",
     "4 GPU(s) visible to 4 rank(s)"),
])
def test_doctor_slurm_checks(slots: int, slurm: dict, gpus: int, cpus: str, gpu_status: str,
                             words: str) -> None:
    found = _doctor(slots, slurm, gpus)
    assert [(c, s) for c, s, _ in found] == [("slurm cpus", cpus), ("slurm gpus", gpu_status)]
    assert any(words in detail for _, _, detail in found), found
