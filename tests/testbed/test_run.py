"""`ptcluster run` across a real multi-host testbed (namespaces + sshd): ranks, faults, teardown.

Every test checks that no process of its job survives on any node (the testbed shares one PID
namespace, so a scan of /proc for the job id covers every node).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ptcluster.launch.options import RunOptions
from ptcluster.node.guard.refusal import PORT_LEASED
from tests.support.head import Head, job_id_when_started, only_run, run_head
from tests.support.procs import job_processes
from tests.support.testbed import next_port

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
PY = sys.executable
LOSS_MARGIN = 5.0
"""Seconds a loaded 2-core machine may add to the head's own bound on naming a lost node
(``RunOptions.lost_within``: its loop, the stderr pipe to the test, the test's 50 ms polls)."""

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


IDLE = textwrap.dedent("""
    import time, torch.distributed as dist
    dist.init_process_group("gloo")
    print("ready", flush=True)
    for _ in range(1200):  # no collectives: its peers' end does not end it
        time.sleep(0.1)
""")


@pytest.fixture
def job_dir(tmp_path):
    for name, text in (("ranks.py", RANKS), ("sleeper.py", SLEEPER), ("fail_on.py", FAIL_ON),
                       ("idle.py", IDLE)):
        (tmp_path / name).write_text(text)
    return tmp_path


def is_guard(cmd: str) -> bool:
    return "zlib" in cmd  # the bootstrap that runs the guard (its job id is its last word)


def head_runs(head: Head) -> Path:
    (arg,) = [a for i, a in enumerate(head.args) if i and head.args[i - 1] == "--run-dir"]
    return head.cwd / arg


def write_cluster(testbed, job_dir, slots=(2, 1, 1), **kw) -> str:
    return testbed.write_cluster(job_dir, slots, python=PY, **kw)


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
    # torch's exit barrier on nodes 1 and 2 used to lose node 0's store when node 0 ended first
    # ("Error waiting on exit barrier" and two tracebacks, in 3 of 6 runs: torchrun_agent.py)
    assert "Traceback" not in head.output()


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
        pids = [p for p, cmd in job_processes(job_id)
                if testbed.node_of_pid(p) == victim and not is_guard(cmd)]
        assert pids
        for pid in pids:  # torchrun and the rank, not the guard: the node stays reachable
            os.kill(pid, signal.SIGKILL)
        code = head.wait(timeout=60)
    finally:
        head.kill()
    assert code == 1, head.output()
    assert f"Root cause (first observed failure): rank 2 on {victim.name}" in "\n".join(head.err)
    assert job_processes(job_id, wait=10) == []


def test_guard_sigkilled_leaves_nothing_on_its_node(testbed, job_dir, no_leftovers) -> None:
    """kill -9 of a node's guard: torchrun dies with it, every rank with torchrun, every rank's
    program with its shim (PR_SET_PDEATHSIG down the chain); the head names the node."""
    head, job_id = start(testbed, job_dir, ["idle.py"])
    no_leftovers.append(job_id)
    victim = testbed.nodes[2]
    try:
        head.wait_for("ready", count=4)
        (guard,) = [p for p, cmd in job_processes(job_id)
                    if testbed.node_of_pid(p) == victim and is_guard(cmd)]
        os.kill(guard, signal.SIGKILL)
        code = head.wait(timeout=60)
        left = [(p, cmd) for p, cmd in job_processes(job_id, wait=10)]
    finally:
        head.kill()
    assert code == 1, head.output()
    assert left == [], left
    # (asked again after the loss, the node answers on the same boot: launch.lost)
    assert f"Root cause (first observed failure): {victim.name}: is up; its guard ended " \
        "(connection lost" in "\n".join(head.err), head.output()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_head_leaves_nothing_on_any_node(testbed, job_dir, sig, no_leftovers) -> None:
    head, job_id = start(testbed, job_dir, ["sleeper.py"])
    no_leftovers.append(job_id)
    try:
        head.wait_for("ready", count=4)
        procs = job_processes(job_id)
        # Every node runs its part; None: the head's own ssh clients (tagged with the job id).
        assert {testbed.node_of_pid(p) for p, _ in procs} == {*testbed.nodes, None}
        assert sum(is_guard(cmd) for _, cmd in procs) == 3  # the guards are seen too
        head.signal(sig)
        code = head.wait(timeout=60)
        assert job_processes(job_id, wait=10) == []
    finally:
        head.kill()
    assert code == 128 + sig, head.output()
    _, summary = only_run(head_runs(head))
    # Ended by the head's stop, each node in order (not by cutting channels after a deadline).
    assert all(n["reason"].startswith("stopped by the head") for n in summary["nodes"]), summary
    assert all(r["status"] == "stopped (job teardown)" for r in summary["ranks"])
    assert "Traceback" not in "\n".join(head.err + head.lines)


def test_sigkill_of_head_group_nodes_end_by_themselves(testbed, job_dir, no_leftovers) -> None:
    head, job_id = start(testbed, job_dir, ["sleeper.py"])
    no_leftovers.append(job_id)
    head.wait_for("ready", count=4)
    head.kill()  # SIGKILL to the head's process group: no cleanup code runs on the head
    assert job_processes(job_id, wait=30) == [], "still running after 30 s"


def test_link_cut_ends_job_everywhere(testbed, job_dir, no_leftovers) -> None:
    victim = testbed.nodes[2]
    head, job_id = start(testbed, job_dir, ["sleeper.py"])
    no_leftovers.append(job_id)
    try:
        head.wait_for("ready", count=4)
        testbed.cut_link(victim)
        cut_at = time.monotonic()
        line = head.err_line(f"stopping the job on every node: {victim.name}: ", timeout=90)
        named = time.monotonic() - cut_at
        code = head.wait(timeout=90)
        others = [p for p, _ in job_processes(job_id, wait=10)
                  if testbed.node_of_pid(p) != victim]
        left = job_processes(job_id, wait=60)  # the cut-off guard ends by itself (heartbeats)
    finally:
        testbed.restore_link(victim)
        head.kill()
    assert code == 1, head.output()
    assert others == [], f"other nodes still run {others}"
    assert left == [], f"the cut-off node still runs {left}"
    # The node that went silent first is the root cause, not a peer whose collective failed.
    err = "\n".join(head.err)
    # Lost by the head's silence rule (8 s; ssh's keepalive, 12 s, is the backstop: the
    # testbed's cluster files keep the product's ssh defaults); asked again (launch.lost), the
    # node behind its cut link does not answer.
    said = f"Root cause (first observed failure): {victim.name}: does not answer (powered " \
        "off, or its network is down) (before: "
    assert f"{said}node lost" in err or f"{said}connection lost" in err, head.output()
    print(f"named {named:.1f} s after the cut: {line}")
    assert named <= RunOptions().lost_within + LOSS_MARGIN, (named, line)


def refused_before_launch(job_dir, cluster: str, no_leftovers) -> tuple[Head, str]:
    """Run ``ranks.py`` on ``cluster``: it must fail (exit 1) with no rank started. The head
    and its stderr."""
    code, head = run_head(["run", "--cluster", cluster, "--run-dir", "runs", "ranks.py", "x"],
                          cwd=job_dir, timeout=60)
    job_id, summary = only_run(job_dir / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    assert all(r["status"] == "not started" for r in summary["ranks"])
    return head, "\n".join(head.err)


def test_unreachable_node_fails_before_launch(testbed, job_dir, no_leftovers) -> None:
    hosts = [testbed.nodes[0].name, testbed.unused_addr]
    cluster = write_cluster(testbed, job_dir, slots=(1, 1), hosts=hosts)
    head, err = refused_before_launch(job_dir, cluster, no_leftovers)
    assert testbed.unused_addr in err and "Fix:" in err
    assert not head.lines or not any(":0]" in line for line in head.lines)


def test_a_master_address_of_another_node_is_refused_before_launch(testbed, job_dir,
                                                                     no_leftovers) -> None:
    """`master.addr` set to node 1's IP while node 0 (rank 0) hosts the rendezvous: plain
    torchrun waits out its rendezvous timeout; here no rank starts and the fix names both."""
    port = next_port()
    cluster = write_cluster(testbed, job_dir, slots=(1, 1),
                            extra=f"master: {{addr: {testbed.nodes[1].addr}, port: {port}}}\n",
                            port=None)
    _, err = refused_before_launch(job_dir, cluster, no_leftovers)
    assert f"the rendezvous address {testbed.nodes[1].addr} is {testbed.nodes[1].name}'s " \
        "address" in err, err


def test_master_port_taken_is_reported_before_launch(testbed, job_dir, no_leftovers) -> None:
    port = next_port()
    master = testbed.nodes[0]
    hog = testbed.exec_in(master, PY, "-c", "import socket,time; s=socket.socket(); "
                          f"s.bind(('0.0.0.0', {port})); s.listen(); print('up', flush=True); "
                          "time.sleep(120)")
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == b"up"
        cluster = write_cluster(testbed, job_dir, port=port)
        _, err = refused_before_launch(job_dir, cluster, no_leftovers)
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()
    assert f"master port {port} is already in use" in err and "--port" in err
    assert master.name in err


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


def test_jobs_with_port_auto_take_free_ports_beside_a_taken_29500(testbed, job_dir,
                                                                   no_leftovers) -> None:
    """Two jobs at once on the same nodes, `master.port: auto`, while something that is not
    ptcluster listens on the master's 29500: each job's master guard leases its own free port
    (the head tells the others with `go`), and both finish."""
    hog = testbed.exec_in(testbed.nodes[0], PY, "-c", "import socket,time; s=socket.socket(); "
                          "s.bind(('0.0.0.0', 29500)); s.listen(); print('up', flush=True); "
                          "time.sleep(120)")
    heads: list[Head] = []
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == b"up"
        for _ in range(2):
            head, job = start(testbed, job_dir, ["sleeper.py", "25"], slots=(1, 1, 1),
                              port=None, extra="master: {port: auto}\n")
            heads.append(head)
            no_leftovers.append(job)
        codes = [h.wait(timeout=120) for h in heads]
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()
        for h in heads:
            h.kill()
    assert codes == [0, 0], "\n\n".join(h.output() for h in heads)
    ports = [only_run(head_runs(h))[1]["attempts"][0]["master_port"] for h in heads]
    assert len(set(ports)) == 2 and all(29500 < p < 30000 for p in ports), ports
    for h, p in zip(heads, ports, strict=True):
        assert f"rendezvous port {p} (auto: the first free one on {testbed.nodes[0].name})" in \
            "\n".join(h.err), h.output()
        assert sum("finished" in line for line in h.lines) == 3, h.output()


def test_a_fixed_port_held_by_a_running_job_is_refused_naming_it(testbed, job_dir,
                                                                 no_leftovers) -> None:
    port = next_port()
    first, job = start(testbed, job_dir, ["sleeper.py", "300"], slots=(1, 1, 1), port=port)
    no_leftovers.append(job)
    try:
        first.wait_for("ready", count=3)
        _, err = refused_before_launch(job_dir, write_cluster(testbed, job_dir, slots=(1, 1, 1),
                                                              port=port), no_leftovers)
    finally:
        first.signal(signal.SIGINT)
        first.wait(timeout=30)
    cause = only_run(job_dir / "runs")[1]["root_cause"]
    assert (cause["host"], cause["code"], cause["fields"]["port"], cause["fix"]) == (
        testbed.nodes[0].name, "guard.port-leased", str(port), PORT_LEASED.fix), err
    assert cause["fields"]["holder"].startswith(f"job {job} (root, python sleeper.py, since "), \
        cause  # (leases.describe: who holds it)
    assert cause["message"] in err and PORT_LEASED.fix in err, err  # (said so)


def test_jobs_share_gpus_by_lease_and_a_taken_gpu_is_refused_naming_its_job(
        testbed, job_dir, no_leftovers) -> None:
    """`gpus: auto` on CPU nodes: indices are leased as on GPU nodes (NVML is skipped, and
    said so) and set in CUDA_VISIBLE_DEVICES. Two jobs at once get disjoint GPUs; an explicit
    `gpus:` that a running job holds is refused naming it; once that job ends, it is free."""
    (job_dir / "cvd.py").write_text(SLEEPER.replace(
        'print("ready", flush=True)',
        'import os; print("ready cvd=" + os.environ["CUDA_VISIBLE_DEVICES"], flush=True)'))
    heads: list[Head] = []
    try:
        for _ in range(2):
            head, job = start(testbed, job_dir, ["cvd.py", "600"], slots=(1, 1, 1),
                              extra="gpus: auto\n")
            heads.append(head)
            no_leftovers.append(job)
            head.wait_for("ready cvd=", count=3)
        seen = [{line.split("ready cvd=")[1] for line in h.lines if "ready cvd=" in line}
                for h in heads]
        assert seen == [{"0"}, {"1"}], seen
        assert f"{testbed.nodes[1].name}: GPUs 1: auto: the first 1 free (skipped 0: job " \
            f"{job_id_of(heads[0])} (root, python cvd.py, since " in "\n".join(heads[1].err), \
            heads[1].output()
        cluster = write_cluster(testbed, job_dir, slots=(1, 1, 1), extra="gpus: [1]\n")
        _, err = refused_before_launch(job_dir, cluster, no_leftovers)
        assert f"1 GPU(s) asked for, 0 free: GPU 1 is in use by job {job_id_of(heads[1])} " \
            "(root, python cvd.py, since " in err, err
        assert "run --wait" in err and "or ask root" in err, err
        # --wait: started while the GPU is held, it says for whom it waits, then starts when
        # the holder ends (its lease goes with its guards) and finishes.
        again = write_cluster(testbed, job_dir, slots=(1, 1, 1), extra="gpus: [1]\n")
        waiter = Head(["run", "--cluster", again, "--run-dir", "runs-wait", "--wait",
                       "ranks.py", str(job_dir)], cwd=job_dir)
        heads.append(waiter)
        deadline = time.monotonic() + 60
        while not any("waiting (--wait, no queue): " in line and job_id_of(heads[1]) in line
                      for line in waiter.err):
            assert time.monotonic() < deadline and waiter.proc.poll() is None, waiter.output()
            time.sleep(0.1)
        heads[1].signal(signal.SIGINT)
        heads[1].wait(timeout=60)
        code = waiter.wait(timeout=120)
        no_leftovers.append(only_run(job_dir / "runs-wait")[0])
        assert code == 0, waiter.output()
        summary = only_run(job_dir / "runs-wait")[1]
        (said,) = summary["waited"]  # said once: the GPU held by the second job, on each node
        assert {(w["code"], w["fields"]["need"], w["fields"]["free"]) for w in said} == {
            ("guard.gpus-busy", "1", "0")}, said
        assert all(job_id_of(heads[1]) in w["fields"]["held"] for w in said), said
        # the refusal it waited out is no failure: no teardown of it (its note has a Fix: to
        # use --wait), no node stopped
        assert not [line for line in waiter.err if "Fix:" in line or line.endswith(": stopped")
                    ], waiter.output()
        assert len(summary["attempts"]) == 1 and summary["failures"] == []
    finally:
        for h in heads:
            if h.proc.poll() is None:
                h.signal(signal.SIGINT)
                try:
                    h.wait(timeout=30)
                except Exception:  # noqa: BLE001 - killed below
                    h.kill()


def test_ps_lists_a_running_job_and_kill_ends_it_everywhere(testbed, job_dir,
                                                            no_leftovers) -> None:
    """`ps` from the leases every node's guard holds; `kill` from where the head is not (here:
    a registry of heads without it, as on another machine) signals the job's guards, which tear
    down as on any stop; the head says who ended it and exits 143."""
    head, job = start(testbed, job_dir, ["sleeper.py", "600"], slots=(2, 1, 1),
                      port=None, extra="master: {port: auto}\n")
    no_leftovers.append(job)
    try:
        head.wait_for("ready", count=4)
        cluster = write_cluster(testbed, job_dir, slots=(1, 1, 1))
        code, ps = run_head(["ps", "--cluster", cluster, "--json"], cwd=job_dir, timeout=60)
        assert code == 0, ps.output()
        (row,) = [r for r in json.loads("\n".join(ps.lines))["jobs"] if r["job_id"] == job]
        assert row["user"] == "root" and row["ranks"] == 4 and row["mine"], row
        assert row["nodes"] == [n.name for n in testbed.nodes] and row["state"] == "running"
        # the program's name, never its arguments (the records are every user's to read)
        assert row["command"] == "python sleeper.py" and 29500 <= row["port"] < 30000, row
        code, table = run_head(["ps", "--cluster", cluster], cwd=job_dir, timeout=60)
        assert code == 0 and job in "\n".join(table.lines), table.output()
        code, killer = run_head(["kill", "--cluster", cluster, job], cwd=job_dir, timeout=60,
                                env={"XDG_STATE_HOME": str(job_dir / "another-machine")})
        assert code == 0, killer.output()
        assert f"job {job}: SIGTERM to its guard on " in "\n".join(killer.lines)
        ended = head.wait(timeout=60)
        left = job_processes(job, wait=30)
    finally:
        head.kill()
    assert ended == 143, head.output()
    assert f"ended by `ptcluster kill` from {socket.gethostname()} (root)" in \
        "\n".join(head.err), head.output()
    assert left == [], left
    code, killer = run_head(["kill", "--cluster", cluster, job], cwd=job_dir, timeout=60)
    assert code == 1 and f"no job {job} runs on these nodes" in "\n".join(killer.err)


def test_kill_where_the_head_runs_stops_every_node_through_it(testbed, job_dir,
                                                              no_leftovers) -> None:
    """`kill` on the head's machine asks the head (its control socket): it stops every node in
    order (each guard says it was stopped by the head), says who, and exits 143."""
    head, job = start(testbed, job_dir, ["sleeper.py", "600"], slots=(2, 1, 1),
                      port=None, extra="master: {port: auto}\n")
    no_leftovers.append(job)
    try:
        head.wait_for("ready", count=4)
        code, killer = run_head(["kill", job], cwd=job_dir, timeout=60)  # no cluster file
        assert code == 0, killer.output()
        assert f"job {job}: ended on every node by its head (pid {head.proc.pid}, on this " \
               "machine)" in "\n".join(killer.lines), killer.output()
        ended = head.wait(timeout=60)
        left = job_processes(job, wait=30)
    finally:
        head.kill()
    assert ended == 143, head.output()
    cause = f"ended by `ptcluster kill` from {socket.gethostname()} (root)"
    assert f"ptcluster: {cause}" in head.err, head.output()
    assert left == [], left
    _, summary = only_run(next(job_dir.glob("runs-*")))
    assert summary["ended_by"] == cause
    assert [n["reason"].startswith("stopped by the head") for n in summary["nodes"]] == \
        [True] * 3, summary["nodes"]


def job_id_of(head: Head) -> str:
    return next(p.name for p in head_runs(head).iterdir() if p.is_dir())


ROOT = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        print("armed", flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.02)
        raise SystemExit(3)
    dist.all_reduce(t)  # rank 0 fails here when rank 1 is gone (connection reset)
""")


def test_root_cause_is_the_first_failure_even_when_its_news_comes_last(
        testbed, job_dir, no_leftovers) -> None:
    """Rank 1 (node 1) fails first; its peer on node 0 fails because of it. The news from
    node 1 is held back (its ssh client is stopped), so the peer's failure reaches the head
    first and starts the teardown. The root cause must still be rank 1."""
    (job_dir / "root.py").write_text(ROOT)
    flag = job_dir / "fail-now"
    head, job_id = start(testbed, job_dir, ["root.py", str(flag)], slots=(1, 1))
    no_leftovers.append(job_id)
    victim = testbed.nodes[1]
    try:
        head.wait_for("armed")
        (ssh,) = [pid for pid in _children(head.proc.pid)
                  if victim.name in _cmdline(pid) and job_id in _cmdline(pid)]
        os.kill(ssh, signal.SIGSTOP)  # the delay: node 1's frames wait in its ssh client
        try:
            flag.touch()
            deadline = time.monotonic() + 30
            while not any("stopping the job" in line for line in head.err):
                assert time.monotonic() < deadline, head.output()
                time.sleep(0.05)
            assert any("rank 0 on" in line for line in head.err if "stopping" in line)
        finally:
            os.kill(ssh, signal.SIGCONT)
        code = head.wait(timeout=60)
    finally:
        head.kill()
    assert code == 1, head.output()
    (cause,) = [line for line in head.err if line.startswith("Root cause")]
    # Its exit code, or (when its exit hangs in torch's shutdown until our teardown) the
    # SystemExit it raised: either way rank 1, not the peer whose news came first.
    assert cause.startswith(f"Root cause (first observed failure): rank 1 on {victim.name}: ")
    _, summary = only_run(head_runs(head))
    root = summary["root_cause"]
    assert (root["rank"], root["host"]) == (1, victim.name), root
    assert root["exit_code"] == 3 or root["facts"] == {"hung_after": "SystemExit: 3"}, root
    assert [f["rank"] for f in summary["failures"]][:2] == [1, 0]
    assert job_processes(job_id, wait=10) == []


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
