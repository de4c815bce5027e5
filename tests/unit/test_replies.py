"""H1: a node's facts are checked where setup receives them (``remote.replies`` at
``NodeSession.ask``) and again where the Slurm files are written. One node's reply with a line
break in its hostname, its ``slurmd -C`` numbers or a GPU file must not put a line into the
``slurm.conf``/``gres.conf`` that root writes on every node: the node is named, the text stays
as it was. The real node program's replies still pass: ``tests/local/test_setup_plan.py``."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ptcluster.cluster.model import SlurmSetupSpec
from ptcluster.node import wire
from ptcluster.remote import replies
from ptcluster.setup.login import NodeFailure, NodeSession
from ptcluster.setup.slurm import slurm_cluster
from tests.unit.test_setup_slurm import ADDRS, KEY, cluster_2_1_1

IDENTITY = {"user": "u", "uid": 1000, "home": "/home/u", "hostname": "gpu-c", "python": "3.11",
            "python_path": "/usr/bin/python3", "sudo": {"mode": "root"}}
INJECTED = "\nHealthCheckProgram=/home/m/x\nHealthCheckInterval=5"


def reply_of(facts: dict[str, Any]) -> dict[str, Any]:
    return {**IDENTITY, "hostname": facts["hostname"], "gpu": facts["gpu"],
            "slurm": facts["slurm"]}


def evil(where: str) -> dict[str, Any]:
    """Node c's facts with a line injected at ``where``."""
    facts = copy.deepcopy(cluster_2_1_1()["c"])
    if where == "hostname":
        facts["hostname"] = "gpu-c\nPrologSlurmctld=/home/m/x"
    elif where == "RealMemory":
        facts["slurm"]["hw"]["RealMemory"] = "1000" + INJECTED
    elif where == "gpu file":
        facts["slurm"]["gpu_files"] = ["/dev/nvidia0" + INJECTED]
    elif where == "gpu count":
        facts["gpu"]["count"] = "1" + INJECTED
    return facts


class Channel:  # what NodeSession sends on; the replies come through on_frames, as from a node
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def send(self, kind: str, payload: object = None) -> None:
        self.sent.append((kind, payload))


def asked(reply: dict[str, Any], only: list[str]) -> dict[str, Any]:
    session = NodeSession(Channel())  # type: ignore[arg-type]
    session.on_frames([wire.encode(wire.Kind.FACTS, reply).decode().rstrip("\n")])
    return dict(session.facts(only, 1.0))


def test_a_well_formed_reply_passes_and_keeps_only_what_was_asked() -> None:
    facts = cluster_2_1_1()["c"]
    got = asked({**reply_of(facts), "hosts": "x", "surprise": 1}, ["slurm"])
    assert got == {**IDENTITY, "slurm": facts["slurm"]}  # (gpu is the os section's)
    got = asked({**reply_of(facts), "hosts": "127.0.0.1 localhost\n"}, ["hosts"])
    assert got["hosts"] == "127.0.0.1 localhost\n" and "slurm" not in got and "gpu" not in got
    # a later ask replaces only its sections in what the head holds: never the hostname
    assert replies.fresh({**reply_of(facts), "hostname": "other"}, ["slurm"]) == {
        "slurm": facts["slurm"], "sudo": IDENTITY["sudo"]}


@pytest.mark.parametrize("where", ["hostname", "RealMemory", "gpu file", "gpu count"])
def test_a_reply_with_a_line_break_fails_that_node_at_the_ask(where: str) -> None:
    with pytest.raises(NodeFailure) as failed:
        asked(reply_of(evil(where)), ["os", "slurm"])
    problem = failed.value.problem
    if where == "hostname":
        assert (problem.code, problem.fields) == (
            "node.hostname-refused", {"hostname": "gpu-c\nPrologSlurmctld=/home/m/x"})
    else:  # the value as the node sent it, shown (repr: the line break is not written)
        assert problem.code == "node.facts-refused" and set(problem.fields) == {
            "where", "value", "want"} and repr(INJECTED)[1:-1] in problem.fields["value"]
    assert problem.fix


@pytest.mark.parametrize("bad", [
    {"hw": {"CPUs": True}}, {"hw_from": "me"}, {"cgroup": "v3"}, {"nvml": "yes"},
    {"gpu_files": ["/dev/sda"]}, {"gpu_files": "/dev/nvidia0"}, {"files": {"x": "y"}},
    {"services": {"munge": {"enabled": 1}}}, {"extra": 1},
])
def test_the_slurm_section_is_checked_whole(bad: dict[str, Any]) -> None:
    facts = copy.deepcopy(cluster_2_1_1()["c"])
    for key, value in bad.items():
        base = facts["slurm"].get(key)
        facts["slurm"][key] = {**base, **value} if isinstance(base, dict) and key != "files" \
            else value
    with pytest.raises(replies.BadReply):
        replies.facts_reply(reply_of(facts), ["slurm"])


@pytest.mark.parametrize("where", ["hostname", "RealMemory", "gpu file", "gpu count"])
def test_facts_that_got_past_the_ask_still_write_no_line(where: str) -> None:
    # the writer's own wall: the Slurm files are not made, and the plan names the node
    facts: dict[str, Any] = {**cluster_2_1_1(), "c": evil(where)}
    sc = slurm_cluster(SlurmSetupSpec(controller="a"), dict(facts), ADDRS, KEY)
    assert sc.files == {}
    assert sc.why.startswith("no Slurm files are written: c: ")
    good = slurm_cluster(SlurmSetupSpec(controller="a"), dict(cluster_2_1_1()), ADDRS, KEY)
    assert "HealthCheck" not in "".join(good.files.values()) and good.files["slurm.conf"]


def test_a_kept_line_of_the_old_slurm_conf_is_words_alone() -> None:
    ok = "NodeName=old NodeAddr=10.0.0.9 CPUs=2 RealMemory=100 Gres=gpu:1 State=UNKNOWN"
    sc = slurm_cluster(SlurmSetupSpec(controller="a"), dict(cluster_2_1_1()), ADDRS, KEY, (ok,))
    assert ok in sc.files["slurm.conf"].splitlines()
    sc = slurm_cluster(SlurmSetupSpec(controller="a"), dict(cluster_2_1_1()), ADDRS, KEY,
                       ("NodeName=old Prolog=/home/m/x\rX",))
    assert sc.files == {} and "a kept line" in sc.why


def test_the_setup_facts_checked_are_the_keys_their_writer_declares() -> None:
    """The head's keys of setup's facts replies (``remote.replies``: the node's identity and
    each section's) are exactly ``node.facts.setup_facts.SetupFacts``'s: a key renamed on one
    side fails here (and mypy fails its readers), not as every node's refused reply."""
    from ptcluster.node.facts.setup_facts import SECTIONS, SetupFacts

    declared = SetupFacts.__required_keys__ | SetupFacts.__optional_keys__
    checked = set(replies.IDENTITY) | {k for keys in replies.SECTION_KEYS.values() for k in keys}
    assert checked == declared
    assert set(replies.SECTION_KEYS) == set(SECTIONS)
    assert set(replies.FIELDS) <= declared


def test_the_slurm_section_checked_is_the_keys_its_writer_declares() -> None:
    """``remote.replies.SLURM`` checks exactly the keys of ``node.facts.slurm_facts``'
    SlurmFacts, and what slurm_facts writes (here from canned command output) passes it with
    the keys of SlurmFacts, MungeKey and Service: a key added on one side fails here."""
    from ptcluster.node.facts import slurm_facts as sf

    def run(argv: list[str]) -> tuple[int, str]:
        if argv[0] == "dpkg-query":
            return 0, "munge install ok installed\nslurmd install ok installed\n"
        if argv[0] == "slurmd":
            return 0, "NodeName=n CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 " \
                      "ThreadsPerCore=1 RealMemory=2048\n"
        if argv[0] == "stat":
            return 0, "munge 400\n"
        if argv[0] == "sha256sum":
            return 0, "ab12 /etc/munge/munge.key\n"
        return 0, "ActiveState=active\nActiveEnterTimestamp=@1700000000\n"  # systemctl

    facts = sf.slurm_facts(run, run, nvml=False)
    assert set(replies.SLURM.fields) == set(sf.SlurmFacts.__annotations__) == set(facts)
    replies.SLURM("slurm", facts)
    assert facts["munge_key"] is not None and set(facts["munge_key"]) == \
        set(sf.MungeKey.__annotations__)
    assert all(set(s) == set(sf.Service.__annotations__) for s in facts["services"].values())
    assert facts["hw_from"] == "slurmd -C" and facts["hw"]["CPUs"] == 2


def test_the_gpu_section_checked_is_the_keys_its_writer_declares() -> None:
    """``remote.replies.GPU`` checks exactly ``node.facts.setup_facts.SetupGpu``'s keys."""
    from ptcluster.node.facts.setup_facts import SetupGpu

    assert set(replies.GPU.fields) == set(SetupGpu.__annotations__)


def test_a_refused_value_is_said_of_the_reply_it_came_in() -> None:
    """The doctor's facts, a node program's answer and a sample refuse a value as the facts do
    (``BadReply.said_of``): their entries take the same fields."""
    from ptcluster.remote.diagnoses import (
        ANSWER_REFUSED,
        DOCTOR_FACTS_REFUSED,
        FACTS_REFUSED,
        SAMPLE_REFUSED,
    )

    assert {e.fields for e in (DOCTOR_FACTS_REFUSED, ANSWER_REFUSED, SAMPLE_REFUSED)} == {
        FACTS_REFUSED.fields}
    with pytest.raises(replies.BadReply) as refused:
        replies.sample_reply({"t": "soon"})
    assert refused.value.problem.code == "node.sample-refused"


def test_a_steps_outcome_is_checked_by_the_keys_its_writer_declares() -> None:
    """``remote.replies.DONE`` (``step_done``, what ``NodeSession.run`` returns) checks exactly
    ``node.setup_agent.StepDone``'s keys, and refuses an outcome without its exit status."""
    from ptcluster.node.setup_agent import StepDone

    assert set(replies.DONE.fields) == set(StepDone.__annotations__)
    assert replies.step_done({"id": 1, "rc": 0, "out": "ok"}) == {"id": 1, "rc": 0, "out": "ok"}
    for bad in ({"id": 1, "out": ""}, {"id": 1, "rc": "0", "out": ""},
                {"id": 1, "rc": 0, "out": None}, {"id": 1, "rc": 0, "out": "", "more": 1}):
        with pytest.raises(replies.BadReply) as refused:
            replies.step_done(bad)
        assert refused.value.problem.code == "node.answer-refused"  # (a step's, not facts)
