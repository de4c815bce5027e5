"""The head's rule for "the job hangs": no running rank made progress for S seconds.

Pure (no clock of its own, no I/O); the supervisor feeds it the guards' heartbeats and asks it
on every tick. Each guard measures its own ranks (``node.guard.progress``: output lines, CPU of the
rank's process tree, collectives completed per the flight recorder) and sends, with every
heartbeat, the seconds since each rank last progressed, so node clocks never matter.

A node the head does not hear from is never a hang: the verdict takes each node's idle seconds
as that node reported them (never extrapolated by the head), so it needs a report sent after
the timeout passed from every node that runs a rank. A node cut off reports nothing more; the
supervisor's silence rule makes it a lost node. A stale report suspends the verdict too.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class HangWatch:
    """The head's hang rule: each node's last idle report, and whether every running rank has
    been idle for ``timeout``."""

    timeout: float
    """S: seconds without progress on every running rank before the job is called hung."""
    fresh: float = 3.0
    """A node's report older than this (or a channel quiet this long) suspends the verdict."""
    reports: dict[str, tuple[dict[int, float], float]] = field(default_factory=dict)
    """host -> (rank -> idle seconds, when the head received it)."""

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ValueError(f"hang timeout must be > 0 s, got {self.timeout}")

    def heartbeat(self, host: str, idle: dict[int, float] | None, now: float) -> None:
        if idle is not None:
            self.reports[host] = (dict(idle), now)

    def idle_for(self, running: dict[int, str], now: float,
                 quiet: dict[str, float]) -> float | None:
        """Seconds that every rank of ``running`` (rank -> host) has made no progress, or None
        when that cannot be told now (a rank unreported, a node silent or stale)."""
        if not running:
            return None
        least: float | None = None
        for rank, host in running.items():
            report = self.reports.get(host)
            if report is None or quiet.get(host, 0.0) > self.fresh:
                return None
            idle, received = report
            age = now - received
            if rank not in idle or age > self.fresh:
                return None
            least = idle[rank] if least is None else min(least, idle[rank])
        return least

    def hung(self, running: dict[int, str], now: float, quiet: dict[str, float]) -> bool:
        idle = self.idle_for(running, now, quiet)
        return idle is not None and idle >= self.timeout
