"""torchrun's agent program (``node/rank/torchrun_agent.py``), run as the guard runs it, with two
real torchrun agents on this machine (node ranks 0 and 1 on 127.0.0.1) and ranks that exit at
once: node 0 must keep its rendezvous store up after its own torchrun succeeded, until every
other node's agent has said it left torch's exit barrier."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from ptcluster.node import TORCHRUN_AGENT
from ptcluster.node.guard.spawn import agent_argv
from ptcluster.node.rank import torchrun_agent
from ptcluster.node.rank_wire import AGENT_FILE
from ptcluster.remote.bootstrap import pack_source

pytestmark = pytest.mark.slow  # starts torchrun
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(tmp: Path, node_rank: int, nodes: int, port: int, worker: str = "true",
          *worker_args: str, ours: bool = True) -> subprocess.Popen[bytes]:
    """One node's torchrun: under the agent program (as the guard starts it), or torch's own."""
    argv = [PY, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank",
            str(node_rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--max-restarts", "0", "--no-python", worker,
            *worker_args]
    return subprocess.Popen(agent_argv(argv, str(tmp)) if ours else argv, cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture
def tmp(tmp_path: Path):
    (tmp_path / AGENT_FILE).write_text(pack_source(TORCHRUN_AGENT))
    procs: list[subprocess.Popen[bytes]] = []
    yield tmp_path, procs
    for proc in procs:  # ended by the test, or here if it failed
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_node_0_keeps_the_store_until_the_other_agents_said_they_are_done(tmp) -> None:
    from torch.distributed import TCPStore

    path, procs = tmp
    port = free_port()
    # Node 1 runs torch's own agent, which never says it is done: node 0 must hold.
    procs += [agent(path, 0, 2, port), agent(path, 1, 2, port, ours=False)]
    out1, _ = procs[1].communicate(timeout=120)
    assert procs[1].returncode == 0, out1.decode()
    time.sleep(1.0)  # node 0's torchrun has long passed the same barrier
    assert procs[0].poll() is None, procs[0].communicate()[0].decode()
    # The store still answers: torch's barrier counted both agents there.
    store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10),
                     wait_for_workers=False)
    assert store.add(torchrun_agent.DONE_KEY, 0) == 0
    started = time.monotonic()
    # As node 1's agent program would: one more done, the last, so "all done".
    assert store.add(torchrun_agent.DONE_KEY, 1) == 1
    store.set(torchrun_agent.ALL_KEY, "1")
    out0, _ = procs[0].communicate(timeout=torchrun_agent.HOLD)
    assert procs[0].returncode == 0, out0.decode()
    assert time.monotonic() - started < 10, "node 0 held on after every agent was done"
    assert b"Traceback" not in out0 + out1


def test_two_agent_programs_end_together_without_a_traceback(tmp) -> None:
    path, procs = tmp
    port = free_port()
    procs += [agent(path, 0, 2, port), agent(path, 1, 2, port)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o.decode() for o in outs]
    assert not any(b"Traceback" in o or b"exit barrier" in o for o in outs), outs


def test_a_failed_torchrun_fails_the_same_and_a_single_node_holds_nothing(tmp) -> None:
    path, procs = tmp
    procs.append(agent(path, 0, 1, free_port(), worker="false"))
    out, _ = procs[-1].communicate(timeout=120)
    assert procs[-1].returncode == 1 and b"ChildFailedError" in out, out.decode()
    started = time.monotonic()
    procs.append(agent(path, 0, 1, free_port()))
    out, _ = procs[-1].communicate(timeout=120)
    assert procs[-1].returncode == 0, out.decode()
    assert time.monotonic() - started < torchrun_agent.HOLD


@pytest.mark.parametrize("ours", [True, False])
def test_the_programs_arguments_are_never_torchruns(tmp, ours: bool) -> None:
    """``ptcluster run train.py --nproc 3``: torch's own parser took ``--nproc`` for an
    abbreviation of two of its options and ended before any rank started."""
    path, procs = tmp
    shown = path / "argv.txt"
    args = ["--nproc", "3", "--nnodes", "9", "--max", "1"]
    procs.append(agent(path, 0, 1, free_port(), PY, "-c",
                       f"import sys; open({str(shown)!r}, 'w').write(repr(sys.argv[1:]))",
                       *args, ours=ours))
    out, _ = procs[-1].communicate(timeout=120)
    if not ours:  # what this fixes
        assert procs[-1].returncode == 2 and b"ambiguous option: --nproc" in out, out.decode()
        return
    assert procs[-1].returncode == 0, out.decode()
    assert shown.read_text() == repr(args)
