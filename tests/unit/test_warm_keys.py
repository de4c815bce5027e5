"""``run --warm``, pure parts: the cluster file's ``warm:`` and ``warm_imports:``, the idle
timeout a run takes, a pool's key, and the rank variables the guard sets for pooled ranks
against torch's own source (``LocalElasticAgent._start_workers``)."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import threading
from pathlib import Path

import pytest

from ptcluster.cli.run_cmd import warm_seconds
from ptcluster.cluster.load import parse_cluster_text
from ptcluster.errors import SpecError
from ptcluster.node.guard.warm_ranks import elastic_env, torchrun_options
from ptcluster.node.warm.protocol import drop_key, hold_key, pool_key

BASE = "nodes: [{host: n1, slots: 2}]\n"


@pytest.mark.parametrize(("text", "idle", "imports"), [
    ("", None, ()),
    ("warm: false\n", None, ()),
    ("warm: true\n", 600.0, ()),
    ("warm: 900\nwarm_imports: [numpy, transformers.models]\n", 900.0,
     ("numpy", "transformers.models")),
])
def test_warm_keys(text: str, idle: float | None, imports: tuple[str, ...]) -> None:
    spec = parse_cluster_text(BASE + text, "c.yaml")
    assert (spec.warm, spec.warm_imports) == (idle, imports)


@pytest.mark.parametrize(("text", "said"), [
    ("warm: 0\n", "warm: must be between 1 and 604800"),
    ("warm: fast\n", "warm: must be an integer"),
    ("warm_imports: numpy\n", "warm_imports: must be a list of module names"),
    ("warm_imports: [\"os; rm -rf\"]\n", "warm_imports: must be a list of module names"),
])
def test_bad_warm_keys_are_named(text: str, said: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_cluster_text(BASE + text, "c.yaml")
    assert said in str(err.value)


@pytest.mark.parametrize(("key", "flag", "idle", "want"), [
    (None, None, None, None), (None, True, None, 600.0), (900.0, None, None, 900.0),
    (900.0, False, None, None), (None, None, 5.0, 5.0), (900.0, True, 5.0, 5.0),
    (None, False, 5.0, None),
])
def test_the_idle_timeout_of_a_run(key, flag, idle, want) -> None:
    assert warm_seconds(key, flag, idle) == want


ENV = {"OMP_NUM_THREADS": "4", "PATH": "/bin", "MASTER_PORT": "1", "PTCLUSTER_JOB_ID": "j1",
       "SSH_CONNECTION": "a b", "HOME": "/root"}


def key(env: dict[str, str] = ENV, **changes) -> str:
    args = {"python": "/py", "digest": "d", "torch": "2.13", "imports": ["numpy"], "env": env,
            "job_names": ["MY_VAR"], **changes}
    return pool_key(**args)[0]


def test_a_pool_is_another_for_any_difference_torch_loads_with() -> None:
    first = key()
    assert key({**ENV, "MASTER_PORT": "2", "PTCLUSTER_JOB_ID": "j2", "SSH_CONNECTION": "c",
                "HOME": "/home/x"}) == first  # one job's, one connection's: the same pool
    for changed in ({"OMP_NUM_THREADS": "8"}, {"LD_PRELOAD": "/x.so"}, {"PYTHONPATH": "/p"},
                    {"MKL_NUM_THREADS": "2"}, {"PYTHONHASHSEED": "0"}, {"MY_VAR": "1"},
                    {"LANG": "C"}):
        assert key({**ENV, **changed}) != first, changed
    for changes in ({"python": "/py2"}, {"digest": "e"}, {"torch": "2.14"},
                    {"imports": ["numpy", "scipy"]}, {"place": "net:2"}):
        assert key(**changes) != first, changes


ARGV = ["/py", "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
        "--nproc-per-node", "3", "--master-addr", "10.0.0.1", "--master-port", "29500",
        "--max-restarts", "0", "--no-python", "/py", "-u", "-c", "BOOT", "train.py",
        "--local-rank=${local_rank}", "--nproc", "3"]


def test_the_node_and_the_program_from_the_plans_torchrun_command() -> None:
    assert torchrun_options(ARGV) == {
        "nnodes": 2, "node_rank": 1, "nproc": 3, "master_addr": "10.0.0.1",
        "master_port": "29500", "target": ["train.py", "--local-rank=${local_rank}", "--nproc",
                                           "3"]}


def torch_worker_keys() -> set[str]:
    """The keys of the ``worker_env`` dict torch's local agent builds for every worker (its
    source, as installed), with ``LOCAL_RANK`` (``_set_local_rank_env``)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / "distributed/elastic/agent/server/local_elastic_agent.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "worker_env"
                                                for t in node.targets) \
                and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)} | \
                {"LOCAL_RANK"}
    raise AssertionError("no worker_env in torch's agent")


def test_a_pooled_rank_gets_every_variable_torchrun_sets() -> None:
    env = elastic_env({"PTCLUSTER_ATTEMPT": "2", "PTCLUSTER_MAX_RESTARTS": "3"},
                      torchrun_options(ARGV), 1, 5, 7, "/tmp/e.json")
    assert torch_worker_keys() <= set(env)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE",
                                "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                                "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS")} == {
        "RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "1", "ROLE_RANK": "5", "WORLD_SIZE": "7",
        "LOCAL_WORLD_SIZE": "3", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3", "OMP_NUM_THREADS": "1"}


def test_a_pools_end_removes_its_key_lock_but_never_under_a_guard_that_holds_it(tmp_path) -> None:
    """``pool-KEY.lock`` goes with the pool's other files (no lock file per key left for ever);
    a guard that waited on the lock of a file removed meanwhile takes the new file's, so two
    guards never both start a pool of one key."""
    lock, sock = str(tmp_path / "pool-k.lock"), str(tmp_path / "pool-k.sock")
    open(sock, "w").close()
    held = hold_key(lock, 1.0)
    drop_key(lock, [sock])  # (a guard holds it: it starts a pool whose files these are)
    assert sorted(os.listdir(tmp_path)) == ["pool-k.lock", "pool-k.sock"]
    with pytest.raises(BlockingIOError):  # (held meanwhile: a pool of the key still imports)
        hold_key(lock, 0.2)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(hold_key(lock, 10.0)))
    waiter.start()  # (blocks on the held lock)
    os.unlink(lock)  # (as drop_key would, had it held the lock first)
    os.close(held)
    waiter.join(10)
    assert got and os.fstat(got[0]).st_ino == os.lstat(lock).st_ino  # the file now at the path
    os.close(got[0])
    drop_key(lock, [sock])
    assert os.listdir(tmp_path) == []


def test_a_pool_imports_on_the_main_thread_what_its_low_priority_thread_cannot(
        tmp_path, monkeypatch) -> None:
    """A job's pool imports on a thread at nice 10; a ``warm_imports`` module that only the
    main thread may import (it calls ``signal.signal``) is imported there after it."""
    from ptcluster.node.warm.pool import load

    (tmp_path / "mainonly_mod.py").write_text(
        "import signal\nsignal.signal(signal.SIGUSR2, signal.getsignal(signal.SIGUSR2))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        torch = load(["mainonly_mod"], nice=10)
        assert torch.__name__ == "torch" and "mainonly_mod" in sys.modules
    finally:
        sys.modules.pop("mainonly_mod", None)


def test_ps_says_whether_a_pool_is_idle_running_ranks_or_held_for_a_runs_ranks() -> None:
    """``idle_since`` None: ranks of it run, or (none yet) a guard holds it between its
    ``ready`` and its ``go`` (``warm.protocol.HOLD``: no idle end meanwhile)."""
    from ptcluster.cli.ps_cmd import PoolRow, pool_line

    def line(idle_since: float | None, ranks: int) -> str:
        row: PoolRow = {"node": "n1", "owner": "me", "pid": 7, "rss": 2**20,
                        "idle_since": idle_since, "ranks": ranks, "idle": 600.0, "torch": "2.13",
                        "python": "/p", "started": 0.0, "job": None}
        return pool_line(row).split("torch 2.13, ")[1]

    assert line(None, 2) == "2 rank(s) running"
    assert line(None, 0) == "held for a run's ranks"
    assert line(0.0, 0).startswith("idle since ") and line(0.0, 0).endswith(
        ", ends after 600 s idle")
