"""The health gate in ``doctor``: the same checks the guard refuses a node by before any rank
starts (``node.health``: too few GPUs for the slots, a nearly full workdir disk, too little
memory available), read on the node by the facts program and shown here. Pure, like every check.
"""

from __future__ import annotations

from typing import Any

from ptcluster.cluster.model import ClusterSpec, NodeSpec
from ptcluster.doctor.checks import FAIL, OK, SKIP, Finding, per_node
from ptcluster.doctor.node_report import NodeReport


def check_health(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """One finding per node: a fail naming what the guard would refuse it for (with the fix),
    else what each check found."""
    def one(node: NodeSpec, facts: dict[str, Any]) -> Finding:
        found = facts.get("health")
        if not isinstance(found, list):
            return Finding("health", node.host, SKIP, "not checked (an older node program)")
        bad = [f for f in found if not f.get("ok")]
        if bad:
            return Finding("health", node.host, FAIL,
                           "run would refuse it: " + "; ".join(str(f["what"]) for f in bad),
                           "; ".join(str(f["fix"]) for f in bad if f.get("fix")) or None)
        return Finding("health", node.host, OK, "; ".join(str(f["what"]) for f in found))
    return per_node(spec, probes, "health", one)
