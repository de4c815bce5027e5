"""The known-failures table (``launch.supervise.known``): each entry matched on what a rank's
shim reports of torch's own exceptions (the GPU-only ones built from torch's types with the
texts torch gives them), carried to the root cause's fix and ``summary.json``; a peer's reset
never the root cause beside the death it follows; ``--local-rank-arg`` in the plan."""

from __future__ import annotations

import argparse
import errno
import json
import signal
from pathlib import Path

import pytest

from ptcluster.cluster import parse_cluster_text
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import Target, plan_launch
from ptcluster.launch.result import Failure, RunResult
from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.known import (
    BY_NAME,
    CONSEQUENCE_WINDOW,
    TABLE,
    VERSIONS,
    RankReport,
    as_markdown,
    differing_versions,
    match_rank,
    order_failures,
    versions_differ,
)
from ptcluster.launch.supervise.supervisor import Status, Supervisor
from ptcluster.node import wire
from ptcluster.node.rank.shim import error_record

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

CLUSTER = "nodes:\n  - {host: a, slots: 2}\n  - {host: b, slots: 1}\n"
WALL = 1_000_000.0

WATCHDOG = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=668, "
            "OpType=ALLREDUCE, NumelIn=52, NumelOut=52, Timeout(ms)=600000) ran for 600097 "
            "milliseconds before timing out.")
NCCL_REMOTE = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, "
               "remote process exited or there was a network error, NCCL version 2.21.5\n"
               "ncclRemoteError: A call failed possibly due to a network error or a remote "
               "process exiting prematurely.")
GLOO_RESET = ("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:41818: Connection reset "
              "by peer")
ADDR_IN_USE = ("The server socket has failed to listen on any local network address. port: "
               "29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in "
               "use")  # (what this machine's torch raised for a taken port)
CONNECT_TIMEOUT = ("The client socket has timed out after 2000ms while trying to connect to "
                   "(10.0.0.1, 29500).")


def text_of(exc: BaseException) -> str:
    """The shim's text of an exception (``shim.run_in_process``)."""
    return f"{type(exc).__name__}: {exc}"[:300]


def reported(exc: BaseException) -> RankReport:
    """What the supervisor gets of ``exc``: the shim's record, decoded as the head does."""
    body = {**error_record(exc, text_of(exc)), "rank": 0}
    event = ev.decode("a", wire.encode(wire.Kind.RERROR, body).decode().rstrip("\n"))
    assert isinstance(event, ev.RankError)
    return RankReport(event.exc, event.text, event.errno, event.usage)


def argparse_exit(argv: list[str], *names: str, required: bool = True) -> SystemExit:
    """The SystemExit a script's own parser raises for ``argv`` (as run by ptcluster)."""
    parser = argparse.ArgumentParser()
    parser.add_argument(*names, type=int, required=required, default=-1)
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        return exc
    raise AssertionError("the parser accepted it")


CASES = [
    (RuntimeError("Distributed package doesn't have NCCL built in"), "nccl-not-built"),
    (torch.AcceleratorError("CUDA error: invalid device ordinal\nGPU device may be out of range, "
                            "do you have enough GPUs?\nCUDA kernel errors might be "
                            "asynchronously reported at some other API call"),
     "invalid-device-ordinal"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                            "capacity of 79.14 GiB of which 1.06 GiB is free."),
     "cuda-out-of-memory"),
    (dist.DistBackendError(WATCHDOG), "collective-timeout"),
    (dist.DistBackendError(NCCL_REMOTE), "peer-gone"),
    (RuntimeError(GLOO_RESET), "peer-gone"),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "peer-gone"),
    (dist.DistNetworkError(ADDR_IN_USE), "address-in-use"),
    (OSError(errno.EADDRINUSE, "Address already in use"), "address-in-use"),
    (dist.DistNetworkError(CONNECT_TIMEOUT), "rendezvous-unreachable"),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "rendezvous-unreachable"),
    (TimeoutError(errno.ETIMEDOUT, "Connection timed out"), "rendezvous-unreachable"),
    (ModuleNotFoundError("No module named 'mylib'", name="mylib"), "module-missing"),
    (argparse_exit([], "--local_rank"), "local-rank-arg-underscore"),
    (argparse_exit([], "--local-rank"), "local-rank-arg-dash"),
    (argparse_exit(["--local-rank=0"], "--local_rank", required=False),
     "local-rank-arg-spelling"),
    (ValueError("loss is nan"), None),
    (argparse_exit(["--local_rank=x"], "--local_rank"), None),  # the flag was given
    (SystemExit(3), None),
]


@pytest.mark.parametrize(("exc", "name"), CASES, ids=[n or f"none-{i}" for i, (_, n) in
                                                     enumerate(CASES)])
def test_each_entry_matches_what_the_shim_reports_of_torchs_exception(exc: BaseException,
                                                                      name: str | None) -> None:
    known = match_rank(reported(exc))
    assert (known and known.name) == name


def test_argparse_message_is_read_from_the_parser_not_its_output() -> None:
    body = error_record(argparse_exit([], "--local_rank"), "SystemExit: 2")
    assert body["exc"] == "SystemExit"
    assert body["usage"] == "the following arguments are required: --local_rank"
    assert "usage" not in error_record(SystemExit(2), "SystemExit: 2")


def test_a_rank_that_reported_nothing_matches_nothing() -> None:
    assert match_rank(RankReport("", "killed", None, "")) is None


def test_the_table_is_plain_data_for_a_docs_page() -> None:
    names = [k.name for k in TABLE]
    assert len(names) == len(set(names)) and set(names) == set(BY_NAME)
    assert all(k.meaning and k.fix and k.title for k in TABLE)
    page = as_markdown()
    for k in TABLE:
        assert f"(`{k.name}`)" in page and k.fix in page
    port, peer = BY_NAME["address-in-use"], BY_NAME["peer-gone"]
    sections = {head: body for head, body in
                (part.split("\n", 1) for part in page.split("\n## ")[1:])}
    assert sections[f"{port.title} (`address-in-use`)"] == (
        "\n- **When**: errno 98 (EADDRINUSE); or its text has “EADDRINUSE” or “address already in "
        f"use”.\n- **Meaning**: {port.meaning}.\n- **Fix**: {port.fix}.\n")
    assert sections[f"{peer.title} (`peer-gone`)"].splitlines()[-2:] == [
        f"- **Fix**: {peer.fix}.", "- **A consequence**: never the root cause when another "
        f"failure happened within {CONSEQUENCE_WINDOW:g} s of it."]
    assert len(sections) == len(TABLE)


def make(facts: dict[str, wire.ReadyFacts] | None = None) -> Supervisor:
    plan = plan_launch(parse_cluster_text(CLUSTER, "c.yaml"), Target(script="t.py"),
                       port=29500, job_id="J")
    sup = Supervisor(plan, RunOptions(), now=0.0, wall_offset=WALL)
    for host in ("a", "b"):
        sup.on_event(ev.Hello(host, wire.VERSION, 10, WALL + 1.0), 1.0)
        sup.on_event(ev.Ready(host, (facts or {}).get(host, {})), 1.0)
    return sup


def raised(sup: Supervisor, host: str, rank: int, exc: BaseException, at: float) -> None:
    """``rank`` raised ``exc`` at ``at`` (node clock, s after WALL) and exited 1 just after."""
    body = {**error_record(exc, text_of(exc)), "rank": rank, "t": WALL + at}
    sup.on_event(ev.decode(host, wire.encode(wire.Kind.RERROR, body).decode().rstrip()), at)
    sup.on_event(ev.RankExit(host, rank, 1, WALL + at + 0.001, at), at + 0.01)


def test_the_fix_is_on_the_root_cause_and_in_summary_json(tmp_path: Path) -> None:
    sup = make()
    raised(sup, "b", 2, RuntimeError("Distributed package doesn't have NCCL built in"), 3.0)
    rc = sup.failures[0]
    known = BY_NAME["nccl-not-built"]
    assert (rc.rank, rc.known, rc.fix, rc.meaning) == (2, known.name, known.fix, known.meaning)
    assert rc.headline().endswith(f"Fix: {known.fix}")
    result = RunResult(job_id="J", run_dir=tmp_path, ranks=sup.ranks, nodes=sup.nodes,
                       failures=sup.failures, interrupted=False, duration=1.0)
    said = json.loads(json.dumps(result.to_json()))["root_cause"]
    assert (said["known"], said["fix"], said["meaning"]) == (known.name, known.fix,
                                                            known.meaning)


@pytest.mark.parametrize("killed_first", [True, False])
def test_a_peers_reset_stamped_first_is_not_the_root_cause(killed_first: bool) -> None:
    """The issue's case: rank 1 SIGKILLed; its peer's "Connection reset by peer" stamped 0.5 ms
    before its exit (…230.16404 against …230.16456), whichever news reaches the head first."""
    sup = make()
    reset = ev.RankError("a", 0, WALL + 230.16404, f"RuntimeError: {GLOO_RESET}", "RuntimeError")
    killed = ev.RankExit("a", 1, -signal.SIGKILL, WALL + 230.16456, 229.0)
    for event in ([killed, reset] if killed_first else [reset, killed]):
        sup.on_event(event, 230.2)
    sup.on_event(ev.RankExit("a", 0, 1, WALL + 230.166, 229.0), 230.2)
    failures = sup.failures
    assert [(f.rank, f.known) for f in failures] == [(1, None), (0, "peer-gone")]
    assert failures[0].message == "killed by SIGKILL"


def test_a_reset_on_another_node_follows_that_nodes_death_on_corrected_clocks() -> None:
    """Node b's clock is 5 s ahead: its death at (b) 235.1 is (head) 230.1, after a's reset
    at 230.09 — still its cause."""
    sup = Supervisor(plan_launch(parse_cluster_text(CLUSTER, "c.yaml"), Target(script="t.py"),
                                 port=29500, job_id="J"), RunOptions(), now=0.0,
                     wall_offset=WALL)
    for host, off in (("a", 0.0), ("b", 5.0)):
        sup.on_event(ev.Hello(host, wire.VERSION, 10, WALL + 1.0 + off), 1.0)
        sup.on_event(ev.Ready(host, {}), 1.0)
    sup.on_event(ev.RankError("a", 0, WALL + 230.09, f"DistBackendError: {NCCL_REMOTE}",
                              "DistBackendError"), 230.2)
    sup.on_event(ev.RankExit("a", 0, 1, WALL + 230.095, 229.0), 230.2)
    sup.on_event(ev.RankExit("b", 2, 1, WALL + 235.1, 229.0), 230.3)
    assert [f.rank for f in sup.failures] == [2, 0]


def test_a_reset_with_no_death_near_it_stays_the_root_cause() -> None:
    """A network fault: the reset is the first thing seen, and the next death comes later than
    the window: nothing explains it better."""
    sup = make()
    later = 230.0 + CONSEQUENCE_WINDOW + 0.5
    sup.on_event(ev.RankError("a", 0, WALL + 230.0, f"RuntimeError: {GLOO_RESET}",
                              "RuntimeError"), later + 0.1)
    sup.on_event(ev.RankExit("a", 0, 1, WALL + 230.001, 229.0), later + 0.1)
    sup.on_event(ev.RankExit("b", 2, 1, WALL + later, 229.0), later + 0.1)
    assert [(f.rank, f.known) for f in sup.failures] == [(0, "peer-gone"), (2, None)]


def test_order_failures_puts_each_consequence_after_its_cause() -> None:
    def f(rank: int | None, at: float, known: str | None = None) -> Failure:
        return Failure(host="h", rank=rank, message="m", at=at, known=known)
    failures = [f(0, 230.16404, "peer-gone"), f(1, 230.16456), f(3, 230.1642, "peer-gone"),
                f(2, 240.0, "peer-gone"), f(None, 230.16456)]
    assert [(x.rank, x.at) for x in order_failures(failures)] == [
        (1, 230.16456), (None, 230.16456), (0, 230.16404), (3, 230.1642), (2, 240.0)]
    both = [f(0, 10.0, "peer-gone"), f(1, 10.2, "peer-gone")]  # no cause: as they came
    assert [x.rank for x in order_failures(both)] == [0, 1]


def test_versions_that_differ_are_said_at_go_and_explain_an_unknown_failure() -> None:
    facts: dict[str, wire.ReadyFacts] = {"a": {"torch": "2.4.0", "nccl": "2.20.5"},
                                         "b": {"torch": "2.5.1", "nccl": "2.20.5"}}
    assert differing_versions(facts) == {"torch": {"a": "2.4.0", "b": "2.5.1"}}
    assert versions_differ(facts) == "a: torch 2.4.0, b: torch 2.5.1"  # (said so)
    assert versions_differ({"a": {"torch": "2.5.1"}, "b": {}}) is None
    plan = plan_launch(parse_cluster_text(CLUSTER, "c.yaml"), Target(script="t.py"),
                       port=29500, job_id="J")
    sup = Supervisor(plan, RunOptions(), now=0.0, wall_offset=WALL)
    notes = []
    for host in ("a", "b"):
        sup.on_event(ev.Hello(host, wire.VERSION, 10, WALL + 1.0), 1.0)
        notes += [a.text for a in sup.on_event(ev.Ready(host, facts[host]), 1.0)
                  if isinstance(a, Status)]
    assert notes[0] == "the nodes' versions differ (a: torch 2.4.0, b: torch 2.5.1): " \
        f"{VERSIONS.fix}"  # (said first at go: the rendering, whole)
    raised(sup, "b", 2, ValueError("cannot unpickle"), 3.0)
    rc = sup.failures[0]
    assert rc.known == "versions-differ" and rc.facts["versions"] == differing_versions(facts)
    assert rc.fix == f"{VERSIONS.fix} (a: torch 2.4.0, b: torch 2.5.1)"


def test_versions_stay_when_the_exception_comes_after_the_exit() -> None:
    """The exit is judged first (versions explain it); the rank's report of a plain exception
    refines the message and keeps that explanation."""
    sup = make({"a": {"torch": "2.4.0"}, "b": {"torch": "2.5.1"}})
    sup.on_event(ev.RankExit("a", 0, 1, WALL + 3.1, 2.0), 3.2)
    sup.on_event(ev.RankError("a", 0, WALL + 3.0, "ValueError: bad pickle", "ValueError"), 3.3)
    rc = sup.failures[0]
    assert (rc.known, rc.at, rc.message) == ("versions-differ", WALL + 3.0,
                                             "exited with code 1 (ValueError: bad pickle)")
    assert rc.facts["versions"] == {"torch": {"a": "2.4.0", "b": "2.5.1"}}, rc.facts


def test_versions_do_not_replace_a_known_failure() -> None:
    sup = make({"a": {"torch": "2.4.0"}, "b": {"torch": "2.5.1"}})
    raised(sup, "a", 0, ModuleNotFoundError("No module named 'x'", name="x"), 3.0)
    assert sup.failures[0].known == "module-missing"


@pytest.mark.parametrize(("style", "flag"), [("dash", "--local-rank"),
                                             ("underscore", "--local_rank")])
def test_local_rank_arg_is_where_torch_distributed_launch_puts_it(style: str, flag: str) -> None:
    """After the script (or module), before its own arguments; torchrun puts each worker's
    local rank in place of the macro (torch's own ``macros``, checked here)."""
    from torch.distributed.elastic.utils.api import macros

    spec = parse_cluster_text(CLUSTER, "c.yaml")
    for target, head in ((Target(script="t.py", args=("--lr", "1"), local_rank_arg=style),
                          ["t.py"]),
                         (Target(module="pkg.train", args=("--lr", "1"), local_rank_arg=style),
                          ["-m", "pkg.train"])):
        argv = list(plan_launch(spec, target, port=29500, job_id="J").nodes[1].argv)
        tail = argv[argv.index("--no-python") + 5:]  # python -u -c SHIM_BOOT
        assert tail == [*head, f"{flag}=${{local_rank}}", "--lr", "1"]
        assert macros.substitute(tail, "1")[len(head)] == f"{flag}=1"
    assert "${local_rank}" not in plan_launch(spec, Target(script="t.py"), port=29500,
                                              job_id="J").nodes[0].argv
    with pytest.raises(ValueError, match="local_rank_arg"):
        Target(script="t.py", local_rank_arg="both")


@pytest.mark.parametrize("error", [
    dist.DistNetworkError(CONNECT_TIMEOUT),
    dist.DistStoreError("Timed out after 11 seconds waiting for clients. 1/2 clients joined."),
])
def test_torchruns_own_failure_is_read_from_its_error_file(tmp_path: Path, error: Exception,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendezvous fails in torchrun, before any rank: its ``@record`` writes the exception
    (torch's own ErrorHandler, here), the guard reads it into its exit frame, and the head
    names the entry with its fix."""
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    from ptcluster.node.guard.spawn import agent_error
    from ptcluster.node.rank_wire import AGENT_ERROR_FILE, AGENT_ERROR_VAR

    assert agent_error(str(tmp_path)) == ""  # none written
    monkeypatch.setenv(AGENT_ERROR_VAR, str(tmp_path / AGENT_ERROR_FILE))
    ErrorHandler().record_exception(error)
    said = agent_error(str(tmp_path))
    assert said == f"{type(error).__name__}: {error}"
    sup = make()
    frame = wire.encode(wire.Kind.EXIT, {"code": 1, "reason": "job ended", "error": said})
    sup.on_event(ev.decode("b", frame.decode().rstrip()), 20.0)
    rc = sup.failures[0]
    known = BY_NAME["rendezvous-unreachable"]
    assert (rc.host, rc.rank, rc.known, rc.fix) == ("b", None, known.name, known.fix)
    assert rc.message == f"torchrun exited with code 1 ({said})"
