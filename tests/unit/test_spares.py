"""Hot spares (``spares:``): the cluster file's key, the restart rule that puts a spare in a lost
or refused node's place (``launch.supervise.restart``), and the plan of that restart
(``launch.plan.replan``). The testbed runs them: ``tests/testbed/test_spares.py``."""

from __future__ import annotations

import pytest

from ptcluster.cluster.load import parse_cluster_text
from ptcluster.errors import SpecError
from ptcluster.launch.plan import Target, plan_launch, replan
from ptcluster.launch.result import AttemptRecord, Failure, FailureKind, RunResult
from ptcluster.launch.supervise.restart import RestartPolicy, decide, failed_join

CLUSTER = """
nodes: [n1:2, n2, n3]
spares:
  - {host: s1, slots: 1, interface: ens9}
  - s2:2
interface: eth0
python: /venv/bin/python
workdir: /w
"""


def test_spares_are_shaped_like_nodes_and_run_no_rank() -> None:
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    assert [(s.host, s.slots, s.interface) for s in spec.spares] == [
        ("s1", 1, "ens9"), ("s2", 2, "eth0")]  # its own keys over the cluster-wide ones
    assert spec.spares[1].python == "/venv/bin/python" and spec.spares[1].workdir == "/w"
    assert spec.world_size == 4  # the nodes' slots only
    plan = plan_launch(spec, Target(module="m"), port=29500, job_id="J")
    assert [n.host for n in plan.nodes] == ["n1", "n2", "n3"]
    assert [n.host for n in spec.machines] == ["n1", "n2", "n3", "s1", "s2"]
    assert [n.host for n in spec.spares_as_nodes().nodes] == ["n1", "n2", "n3", "s1", "s2"]


@pytest.mark.parametrize(("text", "path", "words"), [
    ("nodes: [a]\nspares: [a]\n", "spares[0].host", "duplicate host 'a' (also nodes[0])"),
    ("nodes: [a]\nspares: [b, B]\n", "spares[1].host", "(also spares[0])"),
    ("nodes: [a]\nspares: b\n", "spares", "must be a list"),
    ("nodes: [a]\nspares: [{slots: 2}]\n", "spares[0].host", "is missing"),
    ("nodes: [a]\nspares: [{host: b, sluts: 2}]\n", "spares[0].sluts", "did you mean 'slots'"),
    ("nodes: [a]\nspares: [{host: b, slots: 0}]\n", "spares[0].slots", "must be >= 1"),
    ("nodes: [a]\nspares: [{host: b, slots: 2, gpus: [0]}]\n", "spares[0].gpus",
     "1 GPU(s) for 2 slot(s)"),
    ("nodes: [a]\nspares: [{host: 'b;rm -rf /'}]\n", "spares[0].host", "not a valid hostname"),
])
def test_a_bad_spare_is_named_with_its_path_and_fix(text: str, path: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_cluster_text(text, "c.yaml")
    assert f"c.yaml: {path}:" in str(err.value) and words in str(err.value), str(err.value)
    assert "Fix:" in str(err.value)


def test_a_spare_needs_trust_for_what_a_node_needs_it_for(tmp_path) -> None:
    """Its ``python:`` inside the file's folder, its ssh options that run a program: refused
    from a file the user did not vouch for, as a node's are (``cluster.trust``)."""
    code = str(tmp_path)
    for spare in (f"{{host: b, python: {tmp_path}/venv/bin/python}}",
                  "{host: b, ssh: {options: {ProxyCommand: nc %h %p}}}"):
        text = f"nodes: [a]\nspares: [{spare}]\n"
        with pytest.raises(SpecError, match=r"spares\[0\]"):
            parse_cluster_text(text, "c.yaml", code_dir=code)
        assert parse_cluster_text(text, "c.yaml", trusted=True, code_dir=code).spares


def attempt(number: int, hosts: list[str], cause: Failure | None = None, *, started: bool = True,
            replaced: dict[str, str] | None = None,
            readmitted: list[str] | None = None) -> AttemptRecord:
    return AttemptRecord(number=number, hosts=hosts, world_size=len(hosts), master_port=1,
                         started_at=0.0, cause=cause, ranks_started_at=1.0 if started else None,
                         replaced=replaced or {}, readmitted=readmitted or [])


def lost(host: str, kind: FailureKind = FailureKind.LOST) -> Failure:
    return Failure(host=host, rank=None, kind=kind, message="stopped answering")


POLICY = RestartPolicy(max_restarts=1, min_nodes=3)


def test_a_spare_takes_a_lost_nodes_place_and_keeps_the_node_count() -> None:
    f = lost("n2")
    d = decide(POLICY, [attempt(0, ["n1", "n2", "n3"], f)], [f], False, spares=("s1", "s2"))
    assert d.restart and d.drop == ("n2",) and d.replace == (("n2", "s1"),)
    assert d.reason == "restart 1 of 1: spare s1 replaces n2 (lost)"
    # without spares, --min-nodes 3 ends the job as before
    d = decide(POLICY, [attempt(0, ["n1", "n2", "n3"], f)], [f], False)
    assert not d.restart and d.replace == ()
    assert d.reason == "only 2 node(s) would remain after dropping n2 (lost); --min-nodes is 3"


def test_a_refused_node_is_replaced_too_and_says_why() -> None:
    f = Failure(host="n3", rank=None, kind=FailureKind.UNHEALTHY, message="disk nearly full")
    d = decide(POLICY, [attempt(0, ["n1", "n2", "n3"], f)], [f], False, spares=("s1",))
    assert d.replace == (("n3", "s1"),) and dict(d.why) == {"n3": "unhealthy: disk nearly full"}


def test_two_nodes_lost_with_one_spare_the_shrink_rule_takes_the_other() -> None:
    f1, f2 = lost("n1"), lost("n3")
    first = attempt(0, ["n1", "n2", "n3"], f1)
    d = decide(RestartPolicy(max_restarts=2, min_nodes=2), [first], [f1, f2], False,
               spares=("s1",))
    assert d.restart and d.drop == ("n1", "n3") and d.replace == (("n1", "s1"),)
    assert d.reason == "restart 1 of 2: spare s1 replaces n1 (lost); without n3 (lost)"
    # --min-nodes 3: one spare is not enough; the reason says no spare was left
    d = decide(RestartPolicy(max_restarts=2, min_nodes=3), [first], [f1, f2], False,
               spares=("s1",))
    assert not d.restart
    assert d.reason == ("only 2 node(s) would remain after dropping n1 (lost), n3 (lost); no "
                        "spare left; --min-nodes is 3")


def test_a_spare_that_fails_to_join_is_dropped_and_not_counted_as_a_restart() -> None:
    """s1 was put in n2's place; the next attempt failed before any rank started because s1
    did not come up: s2 takes the place, still restart 1 of 1."""
    f = lost("n2")
    first = attempt(0, ["n1", "n2", "n3"], f, replaced={"n2": "s1"})
    for kind in (FailureKind.START, FailureKind.UNHEALTHY, FailureKind.LOST):
        s1 = lost("s1", kind)
        second = attempt(1, ["n1", "n3", "s1"], s1, started=False)
        assert failed_join([first, second], 1)
        d = decide(POLICY, [first, second], [s1], False, spares=("s2",))
        assert d.restart and d.drop == ("s1",) and d.replace == (("s1", "s2"),), d
        assert d.reason.startswith("spare s1 failed to join, not counted as a restart; "
                                   "restart 1 of 1: spare s2 replaces s1 ("), d.reason
        assert d.reason.endswith("(could not start)" if kind is FailureKind.START else
                                 "(unhealthy: stopped answering)" if kind is
                                 FailureKind.UNHEALTHY else "(lost)"), d.reason
    # no spare left: the shrink rule (here --min-nodes 3: the job ends, saying why)
    s1 = lost("s1", FailureKind.START)
    second = attempt(1, ["n1", "n3", "s1"], s1, started=False)
    d = decide(POLICY, [first, second], [s1], False, spares=())
    assert not d.restart and d.gave_up is not None and d.gave_up.code == "run.too-few-nodes"
    assert d.gave_up.fields == {"left": "2", "dropped": "s1 (could not start)",
                                "spares": "; no spare left", "min_nodes": "3"}, d.gave_up
    assert d.reason == d.gave_up.what
    d = decide(RestartPolicy(max_restarts=1, min_nodes=2), [first, second], [s1], False)
    assert d.restart and d.reason == "spare s1 failed to join, not counted as a restart; " \
                                     "restart 1 of 1 without s1 (could not start)"


def test_a_spare_that_ran_and_was_lost_counts_as_a_restart() -> None:
    """Once its ranks started, a spare is a node like the others: its loss uses a restart."""
    f = lost("n2")
    first = attempt(0, ["n1", "n2", "n3"], f, replaced={"n2": "s1"})
    s1 = lost("s1")
    second = attempt(1, ["n1", "n3", "s1"], s1, started=True)
    assert not failed_join([first, second], 1)
    d = decide(POLICY, [first, second], [s1], False, spares=("s2",))
    assert not d.restart and d.reason == "no restarts left (1 of 1 used)"
    # and a node's own failure before its ranks started is not a spare's failed join
    n1 = lost("n1", FailureKind.START)
    second = attempt(1, ["n1", "n3", "s1"], n1, started=False)
    assert not failed_join([first, second], 1)


def test_a_restart_puts_the_spare_after_the_nodes_that_remain() -> None:
    """The rendezvous node lost: the next node of the file hosts it; the spare's ranks come
    after the remaining nodes', with its own slots (s2: 2 slots for n1's 2: world size 4)."""
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    plan = replan(spec, Target(module="m"), job_id="J", attempt=1, hosts=("n2", "n3", "s2"),
                  addresses={"n2": "10.0.0.2"}, port=29501, max_restarts=1)
    assert [(n.host, n.node_rank, n.rank_base, n.nproc) for n in plan.nodes] == [
        ("n2", 0, 0, 1), ("n3", 1, 1, 1), ("s2", 2, 2, 2)]
    assert plan.world_size == 4 and plan.master_addr == "n2" and plan.nodes[0].is_master
    s2 = plan.nodes[2]
    assert s2.argv[s2.argv.index("--nnodes") + 1] == "3"
    assert s2.argv[s2.argv.index("--nproc-per-node") + 1] == "2"
    assert s2.python == "/venv/bin/python" and s2.interface == "eth0"
    # only spares left: the first spare hosts the rendezvous, at its host
    plan = replan(spec, Target(module="m"), job_id="J", attempt=2, hosts=("s1",),
                  addresses={}, port=29502, max_restarts=2)
    assert plan.master_addr == "s1" and plan.world_size == 1 and plan.nodes[0].interface == "ens9"


def test_summary_says_which_spare_replaced_which_node_and_why() -> None:
    first = attempt(0, ["n1", "n2"], lost("n2"), replaced={"n2": "s1"})
    first.dropped, first.dropped_why = ["n2"], {"n2": "lost"}
    result = RunResult(job_id="J", run_dir=None, ranks=[], nodes=[], failures=[],  # type: ignore[arg-type]
                       interrupted=False, duration=1.0, attempts=[first, attempt(1, ["n1", "s1"])])
    body = result.to_json()
    assert body["spares"] == [{"after_attempt": 0, "node": "n2", "spare": "s1", "why": "lost"}]
    assert body["attempts"][0]["replaced"] == {"n2": "s1"}


# -- re-admission at the next restart (issue 45, item 2, without --readmit) ------------------

def test_a_node_that_answers_again_is_taken_back_at_the_next_restart() -> None:
    """n3 was lost (the job shrank to 2 nodes); a rank fails later; n3 answers again: the
    next attempt has it back, the job at full size; never more than the file's 3 nodes."""
    first = attempt(0, ["n1", "n2", "n3"], lost("n3"))
    rank = Failure(host="n1", rank=0, message="exit 1")
    second = attempt(1, ["n1", "n2"], rank)
    policy = RestartPolicy(max_restarts=3, min_nodes=2)
    d = decide(policy, [first, second], [rank], False, returned=("n3",), size=3)
    assert d.restart and d.readmit == ("n3",) and d.drop == () and d.replace == ()
    assert d.reason == "restart 2 of 3: n3 answers again: taken back"
    # a lost node's place goes to the returned node first, then to a spare
    f = lost("n2")
    second = attempt(1, ["n1", "n2"], f)
    d = decide(policy, [first, second], [f], False, spares=("s1",), returned=("n3",), size=3)
    assert d.readmit == ("n3",) and d.replace == (("n2", "s1"),), d
    # with --min-nodes 2 and no spare, the returned node keeps the job going
    d = decide(policy, [first, second], [f], False, returned=("n3",), size=3)
    assert d.restart and d.readmit == ("n3",) and d.drop == ("n2",), d


def test_while_a_spare_holds_its_place_a_returned_node_waits_as_a_spare() -> None:
    first = attempt(0, ["n1", "n2", "n3"], lost("n3"), replaced={"n3": "s1"})
    rank = Failure(host="n1", rank=0, message="exit 1")
    second = attempt(1, ["n1", "n2", "s1"], rank)
    d = decide(RestartPolicy(max_restarts=3), [first, second], [rank], False,
               returned=("n3",), size=3)
    assert d.restart and d.readmit == () and "n3" not in d.reason  # the job never grows past 3
    # the spare is lost later: the returned node takes the place
    f = lost("s1")
    second = attempt(1, ["n1", "n2", "s1"], f)
    d = decide(RestartPolicy(max_restarts=3), [first, second], [f], False,
               spares=("s2",), returned=("n3",), size=3)
    assert d.readmit == ("n3",) and d.drop == ("s1",) and d.replace == (), d


def test_a_node_that_failed_twice_is_not_taken_back_and_the_console_says_so() -> None:
    first = attempt(0, ["n1", "n2", "n3"], lost("n3"))
    second = attempt(1, ["n1", "n2", "n3"], lost("n3"))  # taken back once, lost again
    rank = Failure(host="n1", rank=0, message="exit 1")
    third = attempt(2, ["n1", "n2"], rank)
    d = decide(RestartPolicy(max_restarts=3, min_nodes=2), [first, second, third], [rank],
               False, returned=("n3",), size=3)
    assert d.restart and d.readmit == ()
    assert d.reason == "restart 3 of 3: n3 answers again but failed twice: not taken back"


def test_a_returned_node_that_fails_to_join_is_not_counted_and_goes_again() -> None:
    first = attempt(0, ["n1", "n2", "n3"], lost("n3"))
    rank = Failure(host="n1", rank=0, message="exit 1")
    second = attempt(1, ["n1", "n2"], rank, readmitted=["n3"])
    refused = lost("n3", FailureKind.UNHEALTHY)
    third = attempt(2, ["n1", "n2", "n3"], refused, started=False)
    assert failed_join([first, second, third], 2)
    d = decide(RestartPolicy(max_restarts=2, min_nodes=2), [first, second, third], [refused],
               False, size=3)
    assert d.restart and d.drop == ("n3",), d
    assert d.reason.startswith("n3, taken back, failed to join, not counted as a restart; "
                               "restart 2 of 2 without n3 (unhealthy: "), d.reason


def test_the_next_attempts_hosts_are_the_files_nodes_then_the_spares() -> None:
    from ptcluster.launch.runner import _next_hosts
    from ptcluster.launch.supervise.restart import Decision

    spec = parse_cluster_text(CLUSTER, "c.yaml")
    now = replan(spec, Target(module="m"), job_id="J", attempt=1, hosts=("n2", "n3", "s1"),
                 addresses={}, port=1, max_restarts=3)  # n1 was lost, s1 took its place
    d = Decision(True, "", drop=("n3",), readmit=("n1",), replace=(("n3", "s2"),))
    hosts = _next_hosts(now, spec.nodes, d)
    assert hosts == ("n1", "n2", "s1", "s2")
    plan = replan(spec, Target(module="m"), job_id="J", attempt=2, hosts=hosts, addresses={},
                  port=2, max_restarts=3)
    assert plan.master_addr == "n1" and plan.world_size == 2 + 1 + 1 + 2  # n1 back: its place
