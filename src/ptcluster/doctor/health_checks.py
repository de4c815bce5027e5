"""The health gate in ``doctor``: the same checks the guard refuses a node by before any rank
starts (``node.facts.health``: too few GPUs for the slots, a nearly full workdir disk, too little
memory available, the GPU driver's fatal Xids, ECC and row remapping), read on the node by the
facts program and shown here; and what it only warns of (``node.facts.health.gpu_warnings``: a PCIe
link below its width, slowdowns, Xids 63 and 92). Pure, like every check.
"""

from __future__ import annotations

from typing import Any

from ptcluster.cluster.model import ClusterSpec, NodeSpec
from ptcluster.doctor.checks import FAIL, OK, SKIP, WARN, Finding, per_node
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


def check_gpu_warnings(spec: ClusterSpec, probes: dict[str, NodeReport]) -> list[Finding]:
    """A warning per node whose GPUs work but wear or run slow (none for a node without)."""
    out = []
    for node in spec.nodes:
        report = probes.get(node.host)
        said = report.facts.get("gpu_warnings") if report is not None and report.facts else None
        if said:
            out.append(Finding("gpu-health", node.host, WARN, "; ".join(map(str, said)),
                               "see `nvidia-smi -q` on it; a GPU whose link or clocks stay "
                               "low needs its slot, cooling or power looked at"))
    return out
