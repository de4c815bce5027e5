"""Who is on the cluster: every ptcluster job on the nodes, from the leases their guards hold.

Pure: per node, the lease records the node's sampler read (``leases.held_all``: any user's,
world-readable) and the user that node's session runs as; out come one row per job, as
``ptcluster ps`` shows them. A lease is held only while its guard lives, so a row is a job
that runs now.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ptcluster.node.sharing.records import lease_of, rank_count
from ptcluster.node.wire import LeaseRecord

Seen = dict[str, tuple[str, str, list[LeaseRecord]]]
"""``{host: (its hostname, the session's user, the lease records its sampler sent)}``: the
records as the head took them (``remote.replies.sample_reply``: ``records.sampled``, the one
check, is passed by each)."""


@dataclass
class JobRow:
    job_id: str
    user: str
    head: str
    command: str
    started: float
    nodes: list[str] = field(default_factory=list)
    ranks: int = 0
    gpus: dict[str, list[int]] = field(default_factory=dict)
    """Per node, the GPU indices the job leased there (none: it leased none)."""
    port: int | None = None
    mine: bool = False
    """Run by the user each node's session runs as (``ps`` without ``--all-users``)."""
    state: str = "running"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def job_rows(nodes: Seen) -> list[JobRow]:
    """``{host: (its hostname, the session's user, the lease records)}`` -> jobs, oldest
    first. Each lease counts once, on the node whose hostname its record names (nodes that
    share one lock directory, as containers may, all read every node's leases)."""
    rows: dict[str, JobRow] = {}
    host_of = {hostname: host for host, (hostname, _, _) in nodes.items()}
    seen: set[tuple[str, str]] = set()
    for host, (_, me, records) in nodes.items():
        for r in records:
            job = str(r.get("job_id") or "")
            resource = str(r.get("resource") or "")
            where = str(r.get("node") or "")
            if not job or (where, resource) in seen:
                continue
            seen.add((where, resource))
            node = host_of.get(where, where or host)
            row = rows.get(job)
            if row is None:
                row = rows[job] = JobRow(job_id=job, user=str(r.get("user") or "?"),
                                         head=str(r.get("head") or "?"),
                                         command=str(r.get("command") or ""),
                                         started=float(r.get("since") or 0))
            row.started = min(row.started, float(r.get("since") or row.started))
            row.mine = row.mine or row.user == me
            kind, value = lease_of(r)
            if kind == "job" and node not in row.nodes:
                row.nodes.append(node)
                row.ranks += rank_count(r)
            elif kind == "gpu" and value.isdigit():
                row.gpus.setdefault(node, []).append(int(value))
            elif kind == "port" and value.isdigit():
                row.port = int(value)
    for row in rows.values():
        for ix in row.gpus.values():
            ix.sort()
    return sorted(rows.values(), key=lambda r: (r.started, r.job_id))
