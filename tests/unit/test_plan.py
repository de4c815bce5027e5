"""Spec -> plan -> argv/env, pure; and the ssh command line. No processes, no network."""

from __future__ import annotations

import os
import shlex

import pytest

from ptcluster.cluster import SshSpec, local_cluster, parse_cluster_text
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import LaunchPlan, Target, plan_launch, rank_env, replan, restart_port
from ptcluster.node import GUARD
from ptcluster.remote.bootstrap import BOOTSTRAP, node_argv
from ptcluster.remote.transport import SSH_DEFAULTS, LocalTransport, SshTransport

CLUSTER = """
nodes:
  - {host: n1, slots: 2}
  - {host: n2, slots: 1, interface: ens33, python: /other/python, workdir: /w2}
  - {host: n3, slots: 1}
interface: eth0
python: /venv/bin/python
workdir: /w
env: {NCCL_DEBUG: WARN, WEIRD: "a b; $(x)"}
"""


def _arg(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_2_1_1_plan_ranks_and_argv() -> None:
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    plan = plan_launch(spec, Target(script="train.py", args=("--lr", "0.1")), port=29511,
                       job_id="J")
    assert plan.world_size == 4
    assert [list(n.ranks) for n in plan.nodes] == [[0, 1], [2], [3]]
    assert [n.is_master for n in plan.nodes] == [True, False, False]
    for i, node in enumerate(plan.nodes):
        argv = node.argv
        assert argv[:3] == (node.python, "-m", "torch.distributed.run")
        assert _arg(argv, "--nnodes") == "3"
        assert _arg(argv, "--node-rank") == str(i)
        assert _arg(argv, "--nproc-per-node") == str(spec.nodes[i].slots)
        assert _arg(argv, "--master-addr") == "n1"
        assert _arg(argv, "--master-port") == "29511"
        assert argv[-3:] == ("train.py", "--lr", "0.1")
    assert plan.nodes[1].python == "/other/python" and plan.nodes[1].workdir == "/w2"
    assert plan.nodes[2].workdir == "/w"


def test_env_is_cluster_env_plus_ours_only() -> None:
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    plan = plan_launch(spec, Target(module="m"), port=29500, job_id="J")
    env = dict(plan.nodes[1].env)
    assert env["NCCL_DEBUG"] == "WARN" and env["WEIRD"] == "a b; $(x)"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ens33"
    assert dict(plan.nodes[0].env)["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["PTCLUSTER_JOB_ID"] == "J"
    assert set(env) == {"NCCL_DEBUG", "WEIRD", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                        "PYTHONUNBUFFERED", "PTCLUSTER_BACKEND", "PTCLUSTER_JOB_ID",
                        "PTCLUSTER_ATTEMPT", "PTCLUSTER_MAX_RESTARTS", "TORCH_FR_BUFFER_SIZE"}
    assert env["PTCLUSTER_ATTEMPT"] == "0" and env["PTCLUSTER_MAX_RESTARTS"] == "0"
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert all(len(v) < 100 for v in env.values())  # configuration: no code travels in it
    full = dict(rank_env(plan, plan.nodes[2]))
    assert set(env) < set(full)
    assert full["WORLD_SIZE"] == "4" and full["NODE_RANK"] == "2"
    assert full["MASTER_ADDR"] == "n1" and full["MASTER_PORT"] == "29500"
    assert full["LOCAL_WORLD_SIZE"] == "1"


def test_a_restart_is_planned_over_the_nodes_that_remain() -> None:
    from ptcluster.launch.runner import Restarts
    from ptcluster.launch.supervise.restart import RestartPolicy

    spec = parse_cluster_text(CLUSTER, "c.yaml")
    first = plan_launch(spec, Target(module="m"), port=29500, job_id="J", max_restarts=3)
    restarts = Restarts(RestartPolicy(max_restarts=3), spec, Target(module="m"))
    reported = {"n1": "10.1.0.1", "n2": "10.1.0.2", "n3": "10.1.0.3"}  # the guards' addresses
    # the master's node (n1, 2 slots) was lost
    plan = restarts.next_plan(first, 2, ("n2", "n3"), reported)
    assert [n.host for n in plan.nodes] == ["n2", "n3"] and plan.attempt == 2
    assert [(n.node_rank, n.rank_base) for n in plan.nodes] == [(0, 0), (1, 1)]
    assert plan.master_addr == "n2" and plan.master_port == 29502  # a fresh store
    assert plan.world_size == sum(n.nproc for n in plan.nodes)
    env = dict(plan.nodes[1].env)
    assert (env["PTCLUSTER_ATTEMPT"], env["PTCLUSTER_MAX_RESTARTS"]) == ("2", "3")
    assert "--node-rank" in plan.nodes[1].argv and plan.nodes[1].is_master is False
    assert plan.nodes[0].is_master and plan.nodes[0].argv[plan.nodes[0].argv.index(
        "--master-addr") + 1] == "n2"


@pytest.mark.parametrize("reported, addr", [
    ({"n2": "10.1.0.2"}, "10.1.0.2"),  # where n2's guard said peers reach it
    ({}, "n2"),                         # no report (its guard never got ready): its host
])
def test_a_master_with_its_own_address_moves_to_the_next_nodes_reported_address(
        reported, addr) -> None:
    """`master: {addr: 10.1.0.1}` (a fabric address; hosts are how the head reaches nodes):
    when n1 is lost, n2's host may not even resolve on the nodes; its reported address does."""
    spec = parse_cluster_text(CLUSTER + "master: {addr: 10.1.0.1, port: 29500}\n", "c.yaml")
    first = plan_launch(spec, Target(module="m"), port=29500, job_id="J", max_restarts=3)
    assert first.master_addr == "10.1.0.1"

    def again(hosts: tuple[str, ...]) -> LaunchPlan:
        return replan(spec, Target(module="m"), job_id="J", attempt=1, hosts=hosts,
                      addresses=reported, port=29501, max_restarts=3)
    assert again(("n1", "n3")).master_addr == "10.1.0.1"  # n1 stays: unchanged
    assert again(("n2", "n3")).master_addr == addr


@pytest.mark.parametrize("first, attempt, port", [
    (29500, 2, 29502), (65535, 1, 65534), (0, 3, 0),  # (0: AUTO_PORT, the guard takes one)
])
def test_a_restart_gets_a_fresh_rendezvous_port(first: int, attempt: int, port: int) -> None:
    assert restart_port(first, attempt) == port


def test_module_target_argv() -> None:
    plan = plan_launch(local_cluster(2), Target(module="pkg.mod", args=("-x",)), port=1234,
                       job_id="J")
    (node,) = plan.nodes
    assert node.argv[-3:] == ("-m", "pkg.mod", "-x")
    assert _arg(node.argv, "--master-addr") == "127.0.0.1"
    assert dict(node.env)["GLOO_SOCKET_IFNAME"] == "lo"


def test_a_lost_node_is_named_within_10_s_by_the_heads_rule_with_ssh_behind_it() -> None:
    # The budget (RunOptions.node_silence): the head names a silent node within 10 s of its
    # last byte; at every size a live node would have to miss SILENT_BEATS beats first; ssh's
    # own keepalive gives up later than the head's rule ((CountMax + 1) x Interval).
    from ptcluster.launch.options import SILENT_BEATS

    opts = RunOptions()
    assert opts.lost_within <= 10.0
    for nodes in (1, 512, 1024, 4096):
        assert opts.node_silence >= SILENT_BEATS * opts.heartbeat_for(nodes), nodes
    keepalive = dict(SSH_DEFAULTS)
    gives_up = int(keepalive["ServerAliveInterval"]) * (int(keepalive["ServerAliveCountMax"]) + 1)
    assert opts.lost_within < gives_up
    with pytest.raises(ValueError, match="node_silence"):
        RunOptions(node_silence=3.0)


def test_ssh_argv_batchmode_quoting_and_user_options_first() -> None:
    ssh = SshSpec(user="ubuntu", port=2222, identity_file="/k/id", config_file="/k/cfg",
                  options=(("ServerAliveInterval", "2"), ("ProxyJump", "bastion")))
    argv = SshTransport(host="n1", ssh=ssh).argv(node_argv("/opt/my env/python", GUARD, "J-1"))
    assert argv[0] == "ssh"
    assert argv[argv.index("-F") + 1] == "/k/cfg" and argv[argv.index("-i") + 1] == "/k/id"
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-l") + 1] == "ubuntu"
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert opts.index("ServerAliveInterval=2") < opts.index("BatchMode=yes")
    ours = dict(SSH_DEFAULTS)["ServerAliveInterval"]
    assert ours != "2" and f"ServerAliveInterval={ours}" not in opts  # the user's value wins
    assert "ProxyJump=bastion" in opts and "ConnectTimeout=10" in opts
    assert not any("StrictHostKeyChecking" in o for o in opts)
    assert argv[-3:-1] == ["--", "n1"]
    # The remote command is one shell-quoted string that splits back to the exact argv.
    assert shlex.split(argv[-1]) == ["/opt/my env/python", "-u", "-c", BOOTSTRAP, "guard", "J-1"]


def test_home_relative_python_is_expanded_by_the_node() -> None:
    """`~/venv/bin/python` must reach the node's shell with `~/` bare (it expands there) and
    everything else quoted; locally it is expanded here."""
    argv = SshTransport(host="n1", ssh=SshSpec()).argv(node_argv("~/my venv/bin/python", GUARD))
    assert argv[-1].startswith("~/'my venv/bin/python' -u -c ")
    assert shlex.split(argv[-1][2:])[0] == "my venv/bin/python"
    local = LocalTransport().argv(node_argv("~/v/python", GUARD))
    assert local[0] == os.path.expanduser("~/v/python")


def test_local_transport_runs_argv_as_is() -> None:
    assert LocalTransport().argv(["a b", "c"]) == ["a b", "c"]


def test_guard_config_is_in_the_plan() -> None:
    """plan.json = what is shipped: the guard's config comes from the plan alone."""
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    plan = plan_launch(spec, Target(script="train.py"), port=29500, job_id="J")
    cfg = plan.nodes[0].guard_config(plan, RunOptions())
    assert cfg["target"] == {"script": "train.py"} and cfg["check_port"] == 29500
    assert cfg["interface"] == "eth0" and cfg["detect_interface_for"] is None
    assert cfg["argv"] == list(plan.nodes[0].argv) and cfg["env"] == dict(plan.nodes[0].env)
    assert plan.nodes[1].guard_config(plan, RunOptions())["check_port"] \
        is None


@pytest.mark.parametrize("target, command", [
    (Target(script="train.py", args=("--token", "s3cret", "--lr", "0.1")), "python train.py"),
    (Target(module="pkg.train", args=("--password=hunter2",)), "python -m pkg.train"),
    (Target(code="import os; print(os.environ['KEY'])", args=("k",)), "python -c …"),
    (Target(script="my dir/t.py"), "python 'my dir/t.py'"),
])
def test_the_command_others_see_names_the_program_never_its_arguments(target: Target,
                                                                     command: str) -> None:
    """What goes into the world-readable lease records (``ps``, a busy refusal): the program's
    name; its arguments may hold a secret, and every user of the node can read the record."""
    plan = plan_launch(local_cluster(1), target, port=29500, job_id="J")
    cfg = plan.nodes[0].guard_config(plan, RunOptions())
    assert cfg["command"] == command
    assert cfg["leases"] is True  # (``run --no-leases`` is the one way off, said as unsafe)
    assert plan.nodes[0].guard_config(plan, RunOptions(leases=False))["leases"] is False


def test_heartbeats_grow_longer_only_past_a_fixed_rate_for_the_head() -> None:
    # Up to BEATS_PER_SECOND nodes every node beats every heartbeat_interval; past that the
    # interval grows so that the head takes (and sends) at most that many heartbeats a second,
    # and never over a quarter of the shorter of the two timeouts that give a side up.
    from ptcluster.launch.options import BEATS_PER_SECOND

    opts = RunOptions()
    assert [opts.heartbeat_for(n) for n in (1, 8, BEATS_PER_SECOND)] == [1.0, 1.0, 1.0]
    assert opts.heartbeat_for(2 * BEATS_PER_SECOND) == 2.0
    assert opts.heartbeat_for(100 * BEATS_PER_SECOND) == 2.0  # (8 s of the head's / 4)
    assert RunOptions(node_silence=20.0).heartbeat_for(10**6) == 3.75  # (15 s of the guard's)
    assert RunOptions(heartbeat_interval=2.5, node_silence=10.0).heartbeat_for(1) == 2.5
    text = "nodes:\n" + "".join(f"  - {{host: n{i}, slots: 8}}\n" for i in range(1024))
    plan = plan_launch(parse_cluster_text(text, "c.yaml"), Target(script="t.py"), port=29500,
                       job_id="J")
    assert {n.guard_config(plan, opts)["heartbeat_every"] for n in plan.nodes} == {2.0}


def test_guards_hold_their_output_longer_only_as_the_cluster_grows() -> None:
    # A guard holds its ranks' lines nodes / OUTPUT_WRITES_PER_SECOND s to write them at once,
    # so the head reads that many writes of output a second at most; never over a heartbeat
    # (which takes them along).
    from ptcluster.launch.options import OUTPUT_WRITES_PER_SECOND as W

    opts = RunOptions()
    assert [opts.output_hold_for(n) for n in (1, 8, W, 2 * W)] == [1 / W, 8 / W, 1.0, 2.0]
    assert opts.output_hold_for(4 * W) == 2.0  # (a 2 s heartbeat: its ceiling)
    text = "nodes:\n" + "".join(f"  - {{host: n{i}, slots: 8}}\n" for i in range(2))
    plan = plan_launch(parse_cluster_text(text, "c.yaml"), Target(script="t.py"), port=29500,
                       job_id="J")
    assert {n.guard_config(plan, opts)["output_hold"] for n in plan.nodes} == {2 / W}


def test_every_rank_of_a_job_gets_the_same_threads_whatever_its_node_holds() -> None:
    """2+1+1: the nodes of one rank get OMP_NUM_THREADS=1 as the node of two does (torchrun
    would leave them every core, and DDP's replicas drifted apart); a job of one rank gets none;
    a value of the cluster file's ``env:`` wins."""
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    plan = plan_launch(spec, Target(script="t.py"), port=29511, job_id="J")
    opts = RunOptions()
    assert [n.guard_config(plan, opts)["env_defaults"] for n in plan.nodes] == \
        [{"OMP_NUM_THREADS": "1"}] * 3
    assert all(dict(rank_env(plan, n))["OMP_NUM_THREADS"] == "1" for n in plan.nodes)
    alone = plan_launch(local_cluster(1), Target(script="t.py"), port=29511, job_id="J")
    assert alone.nodes[0].guard_config(alone, opts)["env_defaults"] == {}
    assert "OMP_NUM_THREADS" not in dict(rank_env(alone, alone.nodes[0]))
    own = parse_cluster_text(CLUSTER.replace("env: {", "env: {OMP_NUM_THREADS: 4, "), "c.yaml")
    mine = plan_launch(own, Target(script="t.py"), port=29511, job_id="J")
    assert all(dict(rank_env(mine, n))["OMP_NUM_THREADS"] == "4" for n in mine.nodes)


def test_a_job_with_restarts_has_a_warm_pool_of_its_own_on_each_node_unless_cold() -> None:
    """``--max-restarts``: each guard is told to keep the job's pool (keyed by the node's
    host); ``run --warm`` uses the user's pool instead; ``--cold`` or no restarts: none."""
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    restarts = plan_launch(spec, Target(script="t.py"), port=29500, job_id="J", max_restarts=2)
    once = plan_launch(spec, Target(script="t.py"), port=29500, job_id="J")
    opts = RunOptions(warm_imports=("numpy",))
    assert [n.guard_config(restarts, opts)["warm"] for n in restarts.nodes] == [
        {"idle": 60.0, "imports": ["numpy"], "world": restarts.world_size, "job": n.host}
        for n in restarts.nodes]
    assert "warm" not in once.nodes[0].guard_config(once, opts)
    assert "warm" not in restarts.nodes[0].guard_config(
        restarts, RunOptions(restart_pool=False))
    assert "job" not in restarts.nodes[0].guard_config(restarts, RunOptions(warm=30.0))["warm"]
