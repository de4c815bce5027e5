"""A hostile node's doctor facts (issue 43 item 1): a real process speaks the facts protocol
(the shipped wire module's frames) with a malformed ``ready``; the real facts program runs on
the other node. The bad node is its own failed check, named; the good node's report is whole."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from ptcluster.cluster import parse_cluster_text
from ptcluster.doctor.checks import run_checks
from ptcluster.doctor.collect import collect_facts
from ptcluster.remote.transport import LocalTransport, Transport
from tests.support.hostile import HostileTransport

GOOD = json.loads((Path(__file__).parent / "data" / "testbed_facts.json").read_text())


def _with(path: str, value: Any) -> dict[str, Any]:
    facts = copy.deepcopy(GOOD["node1"]["facts"])
    *parents, last = path.split(".")
    here = facts
    for p in parents:
        here = here[p]
    here[last] = value
    return facts


REFUSED = "node.doctor-facts-refused"


@pytest.mark.parametrize("facts, said", [
    (_with("hostname", "node1\nnode0"), ("node.hostname-refused", None)),
    (_with("listening", "29500"), (REFUSED, "listening")),
    (_with("listening.master", "29500; rm"), (REFUSED, "listening.master")),
    (_with("interfaces", [{"name": 7, "ipv4": ["1.2.3.4/8"]}]), (REFUSED, "interfaces[0].name")),
    (_with("gpus", {"driver": "5" * 2_000_000}), (REFUSED, "gpus.driver")),
    (_with("master.addrs", ["10.0.0.1"] * 100_000), (REFUSED, "master.addrs")),
    (_with("time", float("nan")), (REFUSED, "time")),
    ({"hostname": "node1"}, (REFUSED, "time")),
    (["not", "a", "table"], "not an object"),
])
def test_a_node_with_malformed_facts_is_its_own_failure(facts: Any, said: Any,
                                                        tmp_path: Path) -> None:
    (tmp_path / "facts.json").write_text(json.dumps(facts))
    spec = parse_cluster_text("nodes: [{host: evil}, {host: localhost}]\n", "c.yaml")
    transports: dict[str, Transport] = {"localhost": LocalTransport(),
                                        "evil": HostileTransport("evil", "facts", "ready",
                                                                 tmp_path / "facts.json")}
    reports = collect_facts(spec, transports, master_port=0, timeout=60)
    evil, good = reports["evil"], reports["localhost"]
    assert evil.facts is None and evil.problem is not None
    if isinstance(said, str):  # (the frame is no object: the channel's bad frame, in words)
        assert evil.problem.code is None and said in str(evil.problem), evil.problem
    else:  # (code, the key path refused): the value itself is in the problem's fields
        assert (evil.problem.code, evil.problem.fields.get("where")) == said, evil.problem
    assert good.ok and good.facts is not None and good.problem is None
    results = run_checks(spec, reports)  # never an exception from the bad node's reply
    assert any(r.host == "evil" and r.status == "fail" for r in results)
    assert not [r for r in results if r.host == "localhost" and r.check == "reach"
                and r.status == "fail"]


def test_the_real_facts_program_passes_the_schema() -> None:
    spec = parse_cluster_text("nodes: [{host: localhost}]\n", "c.yaml")
    report = collect_facts(spec, {"localhost": LocalTransport()}, master_port=0)["localhost"]
    assert report.ok, report.problem
