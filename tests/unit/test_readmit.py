"""``run --readmit`` without processes: the step every rank reached (``supervise.readmit``), the
supervisor's planned restart on a fake clock, the restart rule after it (not counted), the
watch's verdicts and the probe's health answer. The testbed runs it:
``tests/testbed/test_spares.py``."""

from __future__ import annotations

import random

import pytest

from ptcluster.cli.exits import BY_OUTCOME, FAILED
from ptcluster.launch.readmit_watch import NodeBack, ReturnWatch, Watched
from ptcluster.launch.result import AttemptRecord, Failure, FailureKind, Outcome, RunResult
from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.readmit import CheckpointReports, Readmissions, common_step
from ptcluster.launch.supervise.restart import RestartPolicy, decide, restarts_used
from ptcluster.launch.supervise.supervisor import Phase, Status
from ptcluster.node.probe import answer
from ptcluster.remote.node_replies import boot_answer
from tests.unit.test_supervisor import WALL, make, sends, start


@pytest.mark.parametrize(("reports", "step"), [
    ({"a": {0: {4, 8}}, "b": {2: {4, 8}}}, 8),
    ({"a": {0: {4, 8, 12}}, "b": {2: {4, 8}}}, 8),  # not the newest one rank reported
    ({"a": {0: {4, 8, 12}, 1: {4, 8}}, "b": {2: {4, 8, 12}}}, 8),  # each reporting rank
    ({"a": {0: {12}}, "b": {2: {4, 8}}}, None),  # no step they all share
    ({"a": {0: {4}}, "b": {}}, None),  # a node that reported nothing holds it back
    ({"a": {0: {4, 8}}, "b": {2: {8, 4}, 3: {8}}}, 8),
    ({}, None),
])
def test_the_step_every_rank_reached(reports: dict, step: int | None) -> None:
    assert common_step(reports) == step


def test_reports_keep_each_ranks_steps() -> None:
    r = CheckpointReports()
    for host, rank, s in [("a", 0, 4), ("b", 2, 4), ("a", 0, 8), ("a", 0, 12), ("b", 2, 8)]:
        r.add(host, rank, s)
    assert r.common_step(2) == 8
    assert r.common_step(3) is None  # a third node never reported


def test_the_kept_step_is_the_rules_step_whatever_the_order() -> None:
    """The reports kept as they come (``CheckpointReports``) give ``common_step``'s answer
    after every report, for reports in any order, from ranks that start reporting late."""
    rng = random.Random(45)
    for _ in range(200):
        ranks = {"a": [0, 1], "b": [2], "c": [3, 4]}
        kept, seen = CheckpointReports(), {h: {} for h in ranks}
        for _ in range(rng.randrange(1, 40)):
            host = rng.choice(sorted(ranks))
            rank, step = rng.choice(ranks[host]), 4 * rng.randrange(1, 8)
            kept.add(host, rank, step)
            seen[host].setdefault(rank, set()).add(step)
            assert kept.common_step(3) == common_step(seen), seen


def test_the_planned_restart_waits_for_the_next_common_checkpoint() -> None:
    w = Readmissions()
    assert w.due(8) is None  # nobody back
    assert w.back("n3", 8) and not w.back("n3", 8)
    assert w.due(8) is None  # the checkpoint it came back at is not the next one
    assert w.due(12) == 12 and w.due(16) == 12  # once due, it stays the step
    assert not w.back("n4", 16) and w.waiting == ("n3",)  # too late for this one


def test_the_supervisor_stops_at_the_step_every_rank_saved_after_the_node_is_back() -> None:
    """Ranks 0, 1 on a (rank 0 reports), rank 2 on b. c answers again after step 8: rank 0's
    step 12 and 16 do not stop the job (b has not saved them); b's step 12 does, at 12."""
    sup = make()
    start(sup)

    def saved(host: str, rank: int, step: int, now: float) -> list:
        return sup.on_event(ev.RankData(host, rank, {"kind": "checkpoint", "step": step}), now)

    saved("a", 0, 8, 2.0)
    saved("b", 2, 8, 2.1)
    said = sup.node_back("c", "", 3.0)
    assert [a.text for a in said if isinstance(a, Status)] == [
        "c answers again and passed its health gate: a planned restart at the next "
        "checkpoint every rank saved takes it back (--readmit)"]
    assert saved("a", 0, 12, 4.0) == [] and saved("a", 0, 16, 5.0) == []
    assert sup.phase is Phase.RUNNING and sup.planned is None
    stop = saved("b", 2, 12, 6.0)
    assert sorted(sends(stop, "stop")) == ["a", "b"] and sup.planned == 12
    assert sup.readmit == ("c",)
    assert [a.text for a in stop if isinstance(a, Status)] == [
        "stopping the job on every node: c is back: a planned restart at step 12 (the "
        "checkpoint every rank saved) takes it back (--readmit; not counted as a restart)"]
    for rank, host in ((0, "a"), (1, "a"), (2, "b")):  # their teardown: no failure
        sup.on_event(ev.RankExit(host, rank, -15, WALL + 6.5, 5.0), 6.5)
    assert sup.failures == []
    result = RunResult(job_id="J", run_dir=None, ranks=sup.ranks, nodes=sup.nodes,  # type: ignore[arg-type]
                       failures=sup.failures, interrupted=sup.interrupted, duration=1.0,
                       planned=sup.planned)
    assert result.outcome is Outcome.PLANNED_RESTART and not result.ok
    assert BY_OUTCOME[Outcome.PLANNED_RESTART] == FAILED  # (never a run's end: see exits)


def test_a_refused_node_is_said_and_plans_nothing() -> None:
    sup = make()
    start(sup)
    said = sup.node_back("c", "failed twice in this run: it is not taken back", 2.0)
    assert [a.text for a in said if isinstance(a, Status)] == [
        "c answers again but failed twice in this run: it is not taken back"]
    sup.on_event(ev.RankData("a", 0, {"kind": "checkpoint", "step": 4}), 3.0)
    assert sends(sup.on_event(ev.RankData("b", 2, {"kind": "checkpoint", "step": 4}), 3.1),
                 "stop") == []


def record(number: int, hosts: list[str], cause: Failure | None = None,
           planned: int | None = None, readmitted: list[str] | None = None) -> AttemptRecord:
    return AttemptRecord(number=number, hosts=hosts, world_size=len(hosts), master_port=1,
                         started_at=0.0, ranks_started_at=1.0, cause=cause, planned=planned,
                         readmitted=readmitted or [])


def test_after_a_planned_restart_the_node_is_taken_back_and_no_restart_is_counted() -> None:
    lost = Failure(host="n3", rank=None, kind=FailureKind.LOST, message="stopped answering")
    first = record(0, ["n1", "n2", "n3"], lost)
    second = record(1, ["n1", "n2"], planned=12)
    policy = RestartPolicy(max_restarts=1, min_nodes=2)
    d = decide(policy, [first, second], [], False, returned=("n3",), size=3)
    assert d.restart and d.readmit == ("n3",) and d.drop == ()
    assert d.reason == "planned restart at step 12 (--readmit, not counted as a restart): " \
                       "n3 taken back"
    third = record(2, ["n1", "n2", "n3"], planned=None)
    assert restarts_used([first, second, third]) == 1  # the one after the loss only
    # a stop asked meanwhile wins; a failure during the planned stop is a failure
    assert not decide(policy, [first, second], [], False, returned=("n3",), size=3,
                      stop_requested=True).restart
    rank = Failure(host="n1", rank=0, message="exit 1")
    failed = record(1, ["n1", "n2"], rank, planned=12)
    d = decide(policy, [first, failed], [rank], False, returned=("n3",), size=3)
    assert not d.restart and d.reason == "no restarts left (1 of 1 used)"


def watched(room: int, twice: frozenset[str] = frozenset()) -> Watched:
    return Watched(away=(), python={}, health={}, job_id="J", transports={}, twice=twice,
                   room=room)


def test_the_watch_says_each_verdict_once() -> None:
    posted: list[NodeBack] = []
    w = ReturnWatch(watched(room=1, twice=frozenset({"n4"})), posted.append)
    w._verdict("n2", {"what": "its workdir disk is nearly full", "fix": "free space"})
    w._verdict("n2", {"what": "its workdir disk is nearly full", "fix": "free space"})
    w._verdict("n2", None)  # fit now, and a place is free
    w._verdict("n3", None)  # the place is taken: it waits as a spare
    w._verdict("n4", None)
    assert [(b.host, b.refused.split(":")[0].split(" (")[0]) for b in posted] == [
        ("n2", "its health gate refuses it"), ("n2", ""), ("n3", "a spare holds its place"),
        ("n4", "failed twice in this run")]


def test_the_probe_answers_with_the_health_gate_when_asked(tmp_path) -> None:
    assert "unfit" not in answer({"job_id": "J"})
    fit = boot_answer(answer({"job_id": "J", "health": {"workdir": str(tmp_path),
                                                         "slots": 1}}))
    assert fit["unfit"] is None
    refused = boot_answer(answer({"job_id": "J", "health": {"workdir": str(tmp_path),
                                                             "slots": 1 << 30}}))
    assert refused["unfit"]["code"] == "health.memory-low", refused
    assert refused["unfit"]["fields"]["slots"] == str(1 << 30)


def test_readmit_without_restarts_is_bad_usage(cli, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("run", "--nproc", "1", "--readmit", "-m", "json.tool")
    assert code == 2, err
    assert cli.problem.code == "cli.readmit-without-restarts" and "--max-restarts" in err


def test_the_console_summary_names_the_planned_restart() -> None:
    import io

    from rich.console import Console

    from ptcluster.cli.run_cmd import _print_attempts

    lost = Failure(host="n3", rank=None, kind=FailureKind.LOST, message="stopped answering")
    attempts = [record(0, ["n1", "n2", "n3"], lost), record(1, ["n1", "n2"], planned=12,
                                                             readmitted=["n3"]),
                record(2, ["n1", "n2", "n3"])]
    attempts[2].ok = True
    out = io.StringIO()
    _print_attempts(Console(file=out, width=200), RunResult(
        job_id="J", run_dir=None, ranks=[], nodes=[], failures=[],  # type: ignore[arg-type]
        interrupted=False, duration=1.0, attempts=attempts))
    lines = out.getvalue().splitlines()
    assert lines[1] == "  attempt 1: world size 2 on 2 node(s): planned restart at step 12 " \
                       "(n3 taken back)", lines


@pytest.mark.parametrize("schema, written", [
    ("KILL", "ptcluster.node.kill:KillAnswer"), ("BOOT", "ptcluster.node.probe:BootAnswer"),
    ("WARM", "ptcluster.node.wire:WarmAnswer"), ("POOL", "ptcluster.node.wire:PoolInfo"),
    ("CKPT", "ptcluster.node.ckpt_list:CkptAnswer"), ("HELD", "ptcluster.node.ckpt_list:StepHeld"),
    ("CONNECT", "ptcluster.node.doctor_facts:Connect")])
def test_each_answer_is_checked_by_the_keys_its_writer_declares(schema: str, written: str):
    """The head's check of kill's and the probe's answers (``remote.node_replies``) names
    exactly the keys of the TypedDict beside the node code that writes them: a key added on
    one side only fails here, not as every node's "malformed answer" in a run."""
    import importlib

    from ptcluster.remote import node_replies

    module, name = written.split(":")
    declared = getattr(importlib.import_module(module), name).__annotations__
    assert set(getattr(node_replies, schema).fields) == set(declared)


def test_the_doctors_sections_are_checked_by_the_keys_their_writer_declares() -> None:
    """The same for the doctor's facts (``node.doctor_facts.DoctorFacts``): every key the head
    checks by structure is one the node declares, and each section it checks field by field
    has exactly the keys of its TypedDict."""
    from typing import get_type_hints

    from ptcluster.node import doctor_facts as written
    from ptcluster.remote import node_replies

    def keys(typed: type) -> set[str]:
        return set(typed.__required_keys__ | typed.__optional_keys__)  # type: ignore[attr-defined]

    assert set(node_replies.FIELDS) <= keys(written.DoctorFacts)
    hints = get_type_hints(written.DoctorFacts)
    declared = {"python": written.PythonFacts, "workdir": written.WorkdirFacts,
                "peers": written.Route, "master": written.MasterRoute, "shm": written.Space,
                "disk": written.Space, "listening": written.Listening}
    assert set(node_replies.SECTIONS) == set(declared)
    for section, typed in declared.items():
        assert typed.__name__ in str(hints[section]), section
        assert set(node_replies.SECTIONS[section].fields) == keys(typed), section


def test_the_ready_frames_gpus_are_checked_by_the_keys_the_guard_declares() -> None:
    """The head's check of a ready frame's ``gpus`` (``remote.guard_replies.GPUS``) names
    exactly ``wire.GpuClaim``'s keys (``guard.gpus.claim`` writes it)."""
    from ptcluster.node.wire import GpuClaim
    from ptcluster.remote import guard_replies

    assert set(guard_replies.GPUS.fields) == set(GpuClaim.__annotations__)


def test_a_timing_frame_is_checked_by_the_keys_the_guard_declares() -> None:
    """A ``timing`` frame's per-rank and node figures (``remote.guard_replies``) are checked by
    exactly ``wire.RankTiming``'s and ``wire.NodeTiming``'s keys (``guard.schedstat``)."""
    from ptcluster.node.wire import NodeTiming, RankTiming
    from ptcluster.remote import guard_replies

    assert set(guard_replies.RANK_FIGURES.fields) == set(RankTiming.__annotations__)
    assert set(guard_replies.NODE_FIGURES.fields) == set(NodeTiming.__annotations__)


def test_the_xid_and_oom_facts_are_checked_by_the_keys_the_guard_declares() -> None:
    """A ``xid`` frame and a failed rank's ``oom`` (``remote.guard_replies``) are checked by
    exactly ``wire.XidFacts``' and ``wire.OomFacts``' keys (``guard.xids``, ``guard.oom``)."""
    from ptcluster.node.wire import OomFacts, XidFacts
    from ptcluster.remote import guard_replies

    assert set(guard_replies.XID.fields) == set(XidFacts.__annotations__)
    assert set(guard_replies.OOM.fields) == set(OomFacts.__annotations__)


def test_a_checkpoint_listing_is_checked_and_a_malformed_one_refused(tmp_path) -> None:
    """``remote.node_replies.ckpt_answer`` passes what ``node.ckpt_list`` lists of a real
    directory, and refuses a listing whose file entry is not ``[path, size]`` (that node's
    named problem in ``checkpoint.collect``, not a KeyError there)."""
    from ptcluster.node.ckpt_list import list_steps
    from ptcluster.remote.node_replies import ckpt_answer
    from ptcluster.remote.replies import BadReply

    step = tmp_path / "step-3"
    step.mkdir()
    (step / "part-0.pt").write_bytes(b"x" * 5)
    (step / "COMPLETE").write_text("{}")
    listed = {"root": str(tmp_path), "steps": list_steps(str(tmp_path))}
    assert ckpt_answer(listed) == listed
    assert listed["steps"][0]["files"] == {"part-0.pt": ["step-3/part-0.pt", 5]}
    for bad in ({"steps": []}, {"root": str(tmp_path), "steps": [{"step": 3, "marker": None,
                                                                  "files": {"a": ["a"]}}]}):
        with pytest.raises(BadReply) as refused:
            ckpt_answer(bad)
        # (collect names the node with this problem, its code kept: collect --json's code)
        assert refused.value.problem.by("n1").code == "node.answer-refused"


@pytest.mark.parametrize("schema, written", [
    ("START", "ptcluster.node.rank.bench_wire:Started"),
    ("ROW", "ptcluster.node.rank.bench_wire:RowDone"),
    ("PAIR", "ptcluster.node.rank.bench_wire:PairDone"),
    ("STEP", "ptcluster.node.rank.step_probe:MeasuredStep"),
    ("PREDICT", "ptcluster.node.rank.step_probe:PredictRecord")])
def test_each_rank_record_is_checked_by_the_keys_its_writer_declares(schema: str,
                                                                    written: str) -> None:
    """The head's check of the bench worker's and the step probe's records
    (``remote.rank_records``) names exactly the keys of the TypedDict beside the rank code that
    writes them."""
    import importlib

    from ptcluster.remote import rank_records

    module, name = written.split(":")
    declared = getattr(importlib.import_module(module), name).__annotations__
    assert set(getattr(rank_records, schema).fields) == set(declared)
