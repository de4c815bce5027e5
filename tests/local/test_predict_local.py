"""`bench --predict` on this machine: the rank-side step probe in a real torch process (with and
without DDP), the whole command on the local cluster, and its plot."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ptcluster.bench.predict import Bucket, BusBw, Measured, predict
from ptcluster.bench.probe import PredictConfig, probe_job
from ptcluster.cluster.load import local_cluster
from ptcluster.examples.mnist.train import model as mnist_model
from ptcluster.launch.plan import Target
from tests.support.head import run_head

ROOT = Path(__file__).resolve().parents[2]

PROBED = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn
    from ptcluster.node.rank.step_probe import install
    install(json.dumps({"warmup": 2, "steps": 3, "min_s": float(sys.argv[3])}),
            lambda body: print(json.dumps(body), flush=True))
    net = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    if sys.argv[1] == "ddp":
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0,
                                world_size=1)
        net = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(int(sys.argv[4]) if len(sys.argv) > 4 else 1000):
        time.sleep(0.02)
        loss = net(torch.randn(24, 784)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("the probe did not end the program")
    if sys.argv[5:] == ["os._exit"]:  # as ptcluster.end_rank leaves: no atexit runs
        sys.stdout.flush()
        os._exit(0)
""")


@pytest.mark.parametrize("mode", ["plain", "ddp"])
def test_the_probe_measures_buckets_batch_and_ends_the_program(mode: str, tmp_path) -> None:
    out = subprocess.run([sys.executable, "-c", PROBED, mode, str(tmp_path / "store"), "0"],
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1, lines  # the record, then the end: step 5 of 1000
    record = json.loads(lines[0])
    assert record["kind"] == "predict" and record["world_size"] == 1
    steps = record["steps"]
    assert len(steps) == 3
    grad = sum(p.numel() * 4 for p in mnist_model().parameters())
    for step in steps:
        assert step["batch"] == 24
        assert step["ddp"] is (mode == "ddp")
        assert sum(b[0] for b in step["buckets"]) == grad  # 407,080 B: one bucket (< 1 MiB)
        assert len(step["buckets"]) == 1
        (nbytes, ready, done), = step["buckets"]
        assert 0 < ready <= done <= step["step_s"]


def test_short_steps_are_measured_for_min_s_and_sent_twice(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-c", PROBED, "plain", str(tmp_path / "s"), "5"],
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr
    first, last = (json.loads(line) for line in out.stdout.splitlines())
    assert len(first["steps"]) == 3  # sent at warmup + steps, in case the job ends
    assert sum(s["step_s"] for s in last["steps"]) >= 5  # then until min_s is measured
    assert len(last["steps"]) > 3
    assert last["steps"][-1]["buckets"]  # the last steps keep their buckets,
    assert all(s["buckets"] is None for s in last["steps"][:-20])  # the others only times


@pytest.mark.parametrize("leaving", ["return", "os._exit"])
def test_a_job_that_ends_before_min_s_sends_every_step_it_measured(leaving: str,
                                                                   tmp_path) -> None:
    # (the first record holds the first 3 steps only: on a node under a CPU quota they may
    # all fall in one period's unthrottled part; bench_predict_accuracy's 1-node mnist row
    # was 4x too fast from it)
    out = subprocess.run([sys.executable, "-c", PROBED, "plain", str(tmp_path / "s"), "60", "12",
                          leaving],
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr
    first, said, last = out.stdout.splitlines()  # the last record at the interpreter's exit
    assert said == "the probe did not end the program"
    first, last = json.loads(first), json.loads(last)
    assert len(first["steps"]) == 3
    assert len(last["steps"]) == 10  # steps 3..12 of the job: every one after the warm-up


@pytest.mark.slow
def test_predict_on_the_local_cluster(tmp_path) -> None:
    code, head = run_head(["bench", "--nproc", "2", "--predict", "--json", "--steps", "5",
                           "--plot", str(tmp_path / "p.png"), "--",
                           "-m", "ptcluster.examples.mnist", "--dataset", "digits",
                           "--no-download"], tmp_path, timeout=240)
    assert code == 0, "\n".join(head.err)
    out = json.loads("\n".join(head.lines))
    (row,) = out["rows"]  # the local cluster is one node
    assert row["nodes"] == 1 and row["ranks"] == 2 and row["efficiency"] == 1.0
    assert out["measured"]["batch"] == 64  # the trainer's default per-rank batch
    assert out["measured"]["ddp"] is True and out["measured"]["grad_bytes"] == 407_080
    assert out["sweep"] is None
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.slow
def test_a_predict_record_the_head_refuses_is_the_probes_failure() -> None:
    """``remote.rank_records``: a ``predict`` record whose steps are not a list (a program's own
    ``report``, here) is refused where the head reads it: the brief run's failure is that
    refusal, its code and where, not a measurement."""
    code = ("from ptcluster.node.rank.api import report\n"
            "report('predict', {'world_size': 1, 'steps': 'x'})\n")
    measured, failure, _ = probe_job(local_cluster(1), Target(code=code),
                                     PredictConfig(warmup=1, steps=1, timeout=120), None)
    assert measured is None and failure is not None
    assert (failure.rank, failure.problem.code) == (0, "node.record-refused")
    assert failure.problem.fields["where"] == "the predict record.steps"


def test_the_plot_is_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from ptcluster.bench.predict_plot import write_prediction_plot

    m = Measured(step_s=0.1, exposed_s=0.0, batch=8, ranks=1, buckets=(Bucket(21 << 20, 0.08),))
    path = write_prediction_plot(predict(m, [1, 1, 1], BusBw(((1, 0.0125),))),
                                 tmp_path / "p.png", "test")
    assert matplotlib.image.imread(path).shape[0] > 100


AVERAGED = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    rank, store, probed, world = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "probed", 3
    if probed:
        from ptcluster.node.rank.step_probe import install
        install(json.dumps({"warmup": 50, "steps": 50}), lambda body: None)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    torch.manual_seed(0)
    net = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(300, 4000), nn.ReLU(), nn.Linear(4000, 10)))  # 2 buckets
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.manual_seed(rank)  # each rank its own data: the gradients differ until averaged
    for _ in range(3):
        loss = net(torch.randn(16, 300)).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    digest = hashlib.sha256()
    for p in net.parameters():
        digest.update(p.detach().numpy().tobytes())
    print(digest.hexdigest(), flush=True)
    dist.destroy_process_group()
""")


def test_the_probes_comm_hook_averages_the_gradients_as_ddp_does(tmp_path) -> None:
    # (the hook divides by the world size itself: DDP's own path divides while it copies
    # into the bucket, by multiplying with 1/3 here; a hook that summed only, or divided by 3,
    # would train a different model: the parameters are compared bit for bit)
    digests = {}
    for how in ("plain", "probed"):
        procs = [subprocess.Popen([sys.executable, "-c", AVERAGED, str(rank),
                                   str(tmp_path / f"store-{how}"), how],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                                       "PYTHONPATH": str(ROOT / "src")})
                 for rank in (0, 1, 2)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
        (digest,) = {out.strip() for out, _ in outs}  # both ranks hold the same parameters
        digests[how] = digest
    assert digests["probed"] == digests["plain"]
