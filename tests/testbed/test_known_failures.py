"""Known failures that need several nodes: a firewall that drops the rendezvous port names the
rendezvous and the fix, from what torchrun wrote of its own failure (its error file)."""

from __future__ import annotations

import textwrap

import pytest

from ptcluster.launch.supervise.known import BY_NAME
from tests.support.head import only_run, run_head
from tests.support.procs import job_processes
from tests.support.testbed import next_port

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

GLOO = textwrap.dedent("""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
""")


def test_a_firewall_dropping_the_rendezvous_is_named_with_the_fix(testbed, tmp_path) -> None:
    """The first node drops its rendezvous port: no rank ever starts, torchrun fails on both
    nodes after its rendezvous timeout (10 s here, from the cluster file's env)."""
    master = testbed.nodes[0]
    port = next_port()
    (tmp_path / "gloo.py").write_text(GLOO)
    cluster = testbed.write_cluster(tmp_path, [1, 1], port=port,
                                    extra='env: {PET_RDZV_CONF: "timeout=10"}\n')
    testbed.nft(master, "add", "table", "inet", "ptcknown")
    testbed.nft(master, "add", "chain", "inet", "ptcknown", "input",
                "{ type filter hook input priority 0 ; }")
    testbed.nft(master, "add", "rule", "inet", "ptcknown", "input", "iifname", "!=", "lo",
                "tcp", "dport", str(port), "drop")
    try:
        code, head = run_head(["run", "--cluster", cluster, "--run-dir", "runs", "gloo.py"],
                              cwd=tmp_path, timeout=120)
    finally:
        testbed.nft(master, "delete", "table", "inet", "ptcknown")
    job_id, summary = only_run(tmp_path / "runs")
    assert code == 1, head.output()
    rc = summary["root_cause"]
    known = BY_NAME["rendezvous-unreachable"]
    assert (rc["kind"], rc["known"], rc["fix"]) == ("node", known.name, known.fix), rc
    assert rc["message"].startswith("torchrun exited with code 1 (Dist"), rc
    line = next(x for x in head.err if x.startswith("Root cause (first observed failure):"))
    assert line.endswith(f"Fix: {known.fix}"), head.output()
    assert all(r["status"] == "not started" for r in summary["ranks"]), summary["ranks"]
    assert not job_processes(job_id, wait=15.0)
