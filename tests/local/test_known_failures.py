"""Known failures as this machine produces them, in real jobs (`ptcluster run` on the local
cluster): the table's entry and fix on the console's root-cause line and in ``summary.json``;
a peer's reset after a rank's SIGKILL is not the root cause; ``--local-rank-arg`` runs a
script written for ``python -m torch.distributed.launch``."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest

from ptcluster.launch.supervise.known import BY_NAME
from tests.support.head import Head, only_run, run_head

pytestmark = pytest.mark.slow

NCCL_SCRIPT = textwrap.dedent("""
    import torch.distributed as dist
    dist.init_process_group("nccl")  # the seeds' DDP script, on a CPU build of torch
""")
PORT_SCRIPT = textwrap.dedent("""
    import sys, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:  # a store of the script's own, on a fixed port
        dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, True)
    dist.barrier()
""")
MISSING_SCRIPT = textwrap.dedent("""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    import ptcluster_no_such_module_here  # the project's own module, not on this node
""")
LAUNCH_SCRIPT = textwrap.dedent("""
    # written for python -m torch.distributed.launch
    import argparse, os, sys, torch.distributed as dist
    parser = argparse.ArgumentParser()
    parser.add_argument("FLAG", type=int, required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    with open(os.path.join(args.out, f"rank{dist.get_rank()}"), "w") as f:
        f.write(f"{vars(args)} {sys.argv[1:]}")
    dist.destroy_process_group()
""")
RESET_SCRIPT = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.zeros(1)
    dist.recv(t, src=1)  # gloo: "Connection closed/reset by peer" when rank 1 dies
""")


def failed_run(tmp_path: Path, args: list[str], no_leftovers: list[str]) -> tuple[Head, dict]:
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", *args], cwd=tmp_path,
                          timeout=120)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    return head, summary


def assert_known(head: Head, summary: dict, name: str, rank: int | None = None) -> None:
    """The root cause is the entry ``name``: its fix on the console's root-cause line and in
    ``summary.json``, with its meaning."""
    known = BY_NAME[name]
    rc = summary["root_cause"]
    assert (rc["known"], rc["fix"], rc["meaning"]) == (name, known.fix, known.meaning), rc
    assert rc["code"] == f"known.{name}", rc
    if rank is not None:
        assert rc["rank"] == rank, rc
    line = next(x for x in head.err if x.startswith("Root cause (first observed failure):"))
    assert line.endswith(f"Fix: {known.fix}"), head.output()
    assert f"  known failure {name}: {known.meaning}" in head.err


def test_nccl_on_a_cpu_torch_names_the_fix(tmp_path: Path, no_leftovers: list[str]) -> None:
    (tmp_path / "ddp.py").write_text(NCCL_SCRIPT)
    head, summary = failed_run(tmp_path, ["ddp.py"], no_leftovers)
    assert_known(head, summary, "nccl-not-built")
    assert "Distributed package doesn't have NCCL built in" in summary["root_cause"]["message"]


def test_a_port_in_use_names_the_fix(tmp_path: Path, no_leftovers: list[str]) -> None:
    (tmp_path / "port.py").write_text(PORT_SCRIPT)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        head, summary = failed_run(tmp_path, ["port.py", str(held.getsockname()[1])],
                                   no_leftovers)
    assert_known(head, summary, "address-in-use", rank=0)
    assert "EADDRINUSE" in summary["root_cause"]["message"]


def test_a_missing_module_names_run_sync(tmp_path: Path, no_leftovers: list[str]) -> None:
    (tmp_path / "missing.py").write_text(MISSING_SCRIPT)
    head, summary = failed_run(tmp_path, ["missing.py"], no_leftovers)
    assert_known(head, summary, "module-missing")
    assert "run --sync" in summary["root_cause"]["fix"]


@pytest.mark.parametrize(("flag", "style"), [("--local_rank", "underscore"),
                                             ("--local-rank", "dash")])
def test_a_torch_distributed_launch_script(tmp_path: Path, no_leftovers: list[str],
                                          flag: str, style: str) -> None:
    """Without the flag it fails, and the fix names it; with it, every rank gets its local
    rank as that launcher gave it (before the script's own arguments)."""
    (tmp_path / "old.py").write_text(LAUNCH_SCRIPT.replace("FLAG", flag))
    out = tmp_path / "out"
    out.mkdir()
    head, summary = failed_run(tmp_path, ["old.py", "--out", str(out)], no_leftovers)
    assert_known(head, summary, f"local-rank-arg-{style}")
    assert summary["root_cause"]["exit_code"] == 2
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs2", "--local-rank-arg",
                           style, "old.py", "--out", str(out)], cwd=tmp_path,
                          timeout=120)
    job_id, summary = only_run(tmp_path / "runs2")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    dest = flag.lstrip("-").replace("-", "_")
    for rank in (0, 1):
        assert (out / f"rank{rank}").read_text() == \
            f"{{'{dest}': {rank}, 'out': '{out}'}} ['{flag}={rank}', '--out', '{out}']"


def test_a_peers_reset_is_not_the_root_cause_of_a_sigkill(tmp_path: Path,
                                                           no_leftovers: list[str]) -> None:
    """Issue 30's case: rank 1 SIGKILLed, rank 0's gloo recv fails on the closed connection
    (stamped before or after rank 1's exit: 1 run in 2 before, here)."""
    (tmp_path / "reset.py").write_text(RESET_SCRIPT)
    head, summary = failed_run(tmp_path, ["reset.py"], no_leftovers)
    rc = summary["root_cause"]
    assert (rc["rank"], rc["exit_code"], rc["known"]) == (1, -9, None), summary["failures"]
    assert f"Root cause (first observed failure): rank 1 on localhost: {rc['message']}" in \
        "\n".join(head.err)
    peer = [f for f in summary["failures"] if f["rank"] == 0]
    assert all(f["known"] == "peer-gone" for f in peer), peer
