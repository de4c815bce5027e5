"""`ptcluster run` across a real multi-host testbed (namespaces + sshd): ranks, faults, teardown.

Every test checks that no process of its job survives on any node (the testbed shares one PID
namespace, so a scan of /proc for the job id covers every node).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import textwrap
import time

import pytest

from tests.jobs import Head, job_id_when_started, only_run, run_head
from tests.procs import job_processes

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
_ports = itertools.count(29610)
PY = sys.executable

RANKS = textwrap.dedent("""
    import json, os, socket, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    info = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK",
            "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "PTC_TEST_HEAD_ONLY", "CLUSTER_VAR")}
    info["host"] = socket.gethostname()
    info["sum"] = t.item()
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(info, f)
    print("done", flush=True)
    dist.destroy_process_group()
""")

SLEEPER = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    print("ready", flush=True)
    t = torch.ones(1)
    for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 600):
        dist.all_reduce(t)
        time.sleep(0.2)
    print("finished", flush=True)
    dist.destroy_process_group()
""")

FAIL_ON = textwrap.dedent("""
    import sys, time, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == int(sys.argv[1]):
        print("rank failing on purpose", flush=True)
        sys.exit(3)
    time.sleep(120)
""")


@pytest.fixture
def job_dir(tmp_path):
    for name, text in (("ranks.py", RANKS), ("sleeper.py", SLEEPER), ("fail_on.py", FAIL_ON)):
        (tmp_path / name).write_text(text)
    return tmp_path


def write_cluster(testbed, job_dir, slots=(2, 1, 1), **kw) -> str:
    path = job_dir / f"cluster-{time.monotonic_ns()}.yaml"
    kw.setdefault("port", next(_ports))
    path.write_text(testbed.cluster_yaml(list(slots), python=PY, workdir=str(job_dir), **kw))
    return str(path)


def start(testbed, job_dir, script_args, slots=(2, 1, 1), **kw) -> tuple[Head, str]:
    cluster = write_cluster(testbed, job_dir, slots, **kw)
    runs = job_dir / f"runs-{time.monotonic_ns()}"
    head = Head(["run", "--cluster", cluster, "--run-dir", str(runs), *script_args], cwd=job_dir)
    return head, job_id_when_started(runs)


def test_2_1_1_job_ranks_on_the_right_hosts(testbed, job_dir, no_leftovers) -> None:
    out = job_dir / "out"
    out.mkdir()
    cluster = write_cluster(testbed, job_dir, extra="env: {CLUSTER_VAR: from-file}\n")
    code, head = run_head(["run", "--cluster", cluster, "--run-dir", "runs", "ranks.py",
                           str(out)], cwd=job_dir, env={"PTC_TEST_HEAD_ONLY": "leak"})
    job_id, summary = only_run(job_dir / "runs")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    names = [n.name for n in testbed.nodes]
    expect_host = [names[0], names[0], names[1], names[2]]
    for rank in range(4):
        info = json.loads((out / f"rank{rank}.json").read_text())
        assert info["RANK"] == str(rank) and info["WORLD_SIZE"] == "4"
        assert info["host"] == expect_host[rank]
        assert info["LOCAL_RANK"] == str(1 if rank == 1 else 0)
        assert info["sum"] == 10.0  # 1+2+3+4: a real all-reduce over every rank
        assert info["GLOO_SOCKET_IFNAME"] == info["NCCL_SOCKET_IFNAME"] == "veth0"
        assert info["CLUSTER_VAR"] == "from-file"
        assert info["PTC_TEST_HEAD_ONLY"] is None  # nothing of the head's env is shipped
        assert f"[{expect_host[rank]}:{rank}] done" in head.lines
    assert [r["host"] for r in summary["ranks"]] == expect_host


def test_script_exit_3_on_rank_2_names_its_node(testbed, job_dir, no_leftovers) -> None:
    head, job_id = start(testbed, job_dir, ["fail_on.py", "2"])
    no_leftovers.append(job_id)
    code = head.wait(timeout=120)
    assert code == 1, head.output()
    err = "\n".join(head.err)
    node1 = testbed.nodes[1].name
    assert f"Root cause (first observed failure): rank 2 on {node1}: exited with code 3" in err
    assert job_processes(job_id, wait=10) == []


def test_node_processes_sigkilled_ends_the_job(testbed, job_dir, no_leftovers) -> None:
    head, job_id = start(testbed, job_dir, ["sleeper.py"])
    no_leftovers.append(job_id)
    try:
        head.wait_for("ready", count=4)
        victim = testbed.nodes[1]
        pids = [p for p, _ in job_processes(job_id) if testbed.node_of_pid(p) == victim]
        assert pids
        t0 = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        code = head.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        head.kill()
    assert code == 1, head.output()
    assert took < 10, f"{took:.1f} s"
    assert victim.name in "\n".join(head.err)
    assert job_processes(job_id, wait=5) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_head_leaves_nothing_on_any_node(testbed, job_dir, sig, no_leftovers) -> None:
    head, job_id = start(testbed, job_dir, ["sleeper.py"])
    no_leftovers.append(job_id)
    try:
        head.wait_for("ready", count=4)
        assert {testbed.node_of_pid(p) for p, _ in job_processes(job_id)} == set(testbed.nodes)
        t0 = time.monotonic()
        head.signal(sig)
        head.wait(timeout=30)
        assert job_processes(job_id, wait=10 - (time.monotonic() - t0)) == []
        assert time.monotonic() - t0 < 10
    finally:
        head.kill()


def test_sigkill_of_head_group_nodes_end_by_themselves(testbed, job_dir, no_leftovers) -> None:
    head, job_id = start(testbed, job_dir, ["sleeper.py"])
    no_leftovers.append(job_id)
    head.wait_for("ready", count=4)
    t0 = time.monotonic()
    head.kill()  # SIGKILL to the head's process group: no cleanup code runs on the head
    assert job_processes(job_id, wait=15) == [], "still running after 15 s"
    assert time.monotonic() - t0 < 15


def test_link_cut_ends_job_everywhere(testbed, job_dir, no_leftovers) -> None:
    victim = testbed.nodes[2]
    head, job_id = start(testbed, job_dir, ["sleeper.py"])
    no_leftovers.append(job_id)
    try:
        head.wait_for("ready", count=4)
        t0 = time.monotonic()
        testbed.cut_link(victim)
        code = head.wait(timeout=60)
        head_took = time.monotonic() - t0
        others = [p for p, _ in job_processes(job_id) if testbed.node_of_pid(p) != victim]
        left = job_processes(job_id, wait=max(0.0, 60 - (time.monotonic() - t0)))
        all_took = time.monotonic() - t0
    finally:
        testbed.restore_link(victim)
        head.kill()
    assert code == 1, head.output()
    assert head_took < 45, f"head ended after {head_took:.1f} s"
    assert others == [], f"other nodes still run {others}"
    assert left == [], f"the cut-off node still runs {left} after {all_took:.0f} s"
    assert victim.name in "\n".join(head.err)


def test_unreachable_node_fails_before_launch(testbed, job_dir, no_leftovers) -> None:
    hosts = [testbed.nodes[0].name, testbed.unused_addr]
    cluster = write_cluster(testbed, job_dir, slots=(1, 1), hosts=hosts)
    t0 = time.monotonic()
    code, head = run_head(["run", "--cluster", cluster, "--run-dir", "runs", "ranks.py", "x"],
                          cwd=job_dir, timeout=60)
    took = time.monotonic() - t0
    job_id, summary = only_run(job_dir / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    assert took < 20, f"{took:.1f} s"
    err = "\n".join(head.err)
    assert testbed.unused_addr in err and "Fix:" in err
    assert all(r["status"] == "not started" for r in summary["ranks"])
    assert not head.lines or not any(":0]" in line for line in head.lines)


def test_master_port_taken_is_reported_before_launch(testbed, job_dir, no_leftovers) -> None:
    port = next(_ports)
    master = testbed.nodes[0]
    hog = testbed.exec_in(master, PY, "-c", "import socket,time; s=socket.socket(); "
                          f"s.bind(('0.0.0.0', {port})); s.listen(); print('up', flush=True); "
                          "time.sleep(120)")
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == b"up"
        cluster = write_cluster(testbed, job_dir, port=port)
        t0 = time.monotonic()
        code, head = run_head(["run", "--cluster", cluster, "--run-dir", "runs", "ranks.py",
                               "x"], cwd=job_dir, timeout=60)
        took = time.monotonic() - t0
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()
    job_id, summary = only_run(job_dir / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    err = "\n".join(head.err)
    assert f"master port {port} is already in use" in err and "--port" in err
    assert master.name in err
    assert took < 20
    assert all(r["status"] == "not started" for r in summary["ranks"])


def test_two_jobs_on_the_same_nodes_stopping_one_spares_the_other(testbed, job_dir,
                                                                  no_leftovers) -> None:
    a, job_a = start(testbed, job_dir, ["sleeper.py", "60"], slots=(1, 1, 1))
    b, job_b = start(testbed, job_dir, ["sleeper.py", "60"], slots=(1, 1, 1))
    no_leftovers.extend([job_a, job_b])
    try:
        a.wait_for("ready", count=3)
        b.wait_for("ready", count=3)
        a.signal(signal.SIGINT)
        a.wait(timeout=30)
        assert job_processes(job_a, wait=10) == []
        assert len(job_processes(job_b)) >= 6  # 3 torchruns + 3 ranks, untouched
        code_b = b.wait(timeout=120)
    finally:
        a.kill()
        b.kill()
    assert code_b == 0, b.output()
    assert sum("finished" in line for line in b.lines) == 3
