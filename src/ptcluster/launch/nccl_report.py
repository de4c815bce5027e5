"""What NCCL chose on each node, in words: one line per node, and a warning for a node with
RDMA devices whose ranks used TCP sockets (the silent fall-back: AReaL#639, nccl#1131).

Pure: the nodes' ``nccl`` (``launch.supervise.events.nccl_chosen``, read by each guard from
NCCL's own log) in, lines and :class:`Problem` s out; ``cli/run_cmd.py`` prints them.
"""

from __future__ import annotations

from collections.abc import Iterable

from ptcluster.errors import Problem
from ptcluster.launch.result import NodeOutcome
from ptcluster.node.problems import Declared

ON_SOCKETS = Declared(
    "run.nccl-on-sockets", "NCCL fell back to TCP sockets on a node with RDMA devices",
    "NCCL used TCP sockets though the node has RDMA devices ({hcas}): likely {cause}",
    "run `ptcluster doctor` (its rdma row says what keeps the HCAs out and how to fix it); "
    "until then this job's traffic between nodes goes over TCP")


def nccl_lines(nodes: Iterable[NodeOutcome]) -> tuple[list[str], list[Problem]]:
    """``node: NCCL over IB (RoCE) mlx5_0:1, GID index 3`` per node that said, and the
    nodes that fell back to sockets with HCAs present."""
    lines, warnings = [], []
    for node in nodes:
        said = node.nccl
        if not said or not said.get("transport"):
            continue
        transport = str(said["transport"])
        if transport == "IB":
            text = f"NCCL over IB ({said.get('link') or '?'}) {said.get('hca') or '?'}"
            if said.get("gid_index") is not None:
                text += f", GID index {said['gid_index']}"
        elif transport == "Socket":
            text = f"NCCL over TCP sockets ({said.get('sockets') or '?'})"
        else:
            text = f"NCCL over {transport}"
        lines.append(f"{node.host}: {text}")
        if (hcas := said.get("hcas")) and "Socket" in transport:
            warnings.append(Problem.of(ON_SOCKETS, node.host,
                                       hcas=", ".join(map(str, hcas)),
                                       cause=said.get("cause") or "?"))
    return lines, warnings
