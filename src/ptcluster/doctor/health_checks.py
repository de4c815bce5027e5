"""The health gate in ``doctor``: the same checks the guard refuses a node by before any rank
starts (``node.facts.health``: too few GPUs for the slots, a nearly full workdir disk, too little
memory available, the GPU driver's fatal Xids, ECC and row remapping), read on the node by the
facts program and shown here; and what it only warns of (``node.facts.health.gpu_warnings``: a PCIe
link below its width, slowdowns, Xids 63 and 92). Pure, like every check.
"""

from __future__ import annotations

from ptcluster.cluster.model import ClusterSpec, NodeSpec
from ptcluster.doctor.checks import OK, SKIP, Finding, per_node
from ptcluster.doctor.findings import GPU_WORN, HEALTH_REFUSED
from ptcluster.doctor.node_report import NodeReport
from ptcluster.errors import Problem
from ptcluster.node.doctor_facts import DoctorFacts


def check_health(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """A fail for each thing the guard would refuse the node for, by its own code
    (``health.*``, with its fix); else one line of what each check found."""
    def one(node: NodeSpec, facts: DoctorFacts) -> list[Finding]:
        found = facts.get("health")
        if not isinstance(found, list):
            return [Finding.plain("health", node.host, SKIP,
                                  "not checked (an older node program)")]
        bad = [f for f in found if not f.get("ok")]
        if bad:
            return [HEALTH_REFUSED.of(Problem.received(node.host, f)) for f in bad]
        return [Finding.plain("health", node.host, OK, "; ".join(str(f["what"]) for f in found))]
    return per_node(spec, probes, "health", one)


def check_gpu_warnings(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """A warning for each way a node's GPUs wear or run slow (``health.*``: none for a node
    without GPUs, or whose GPUs are fine)."""
    out = []
    for node in spec.nodes:
        report = probes.get(node.host)
        warned = report.facts.get("gpu_warnings") if report is not None and report.facts else None
        out += [GPU_WORN.of(Problem.received(node.host, w)) for w in warned or ()]
    return out

