"""Head side of `ptcluster monitor`: one sampler session per node, latest sample per node; and
of `ptcluster ps`: every node's sampler asked once (``remote.group``).

A node that cannot be reached (or whose session dies) is reported as such while the others
keep updating.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ptcluster.cluster.model import ClusterSpec
from ptcluster.control.protocol import ask_straggler, running_jobs
from ptcluster.errors import Problem, PtclusterError
from ptcluster.node import SAMPLER
from ptcluster.node.sampler import SamplerConfig
from ptcluster.node.wire import Kind, Sample, control, split
from ptcluster.remote.channel import NodeChannel, close_all, start_all
from ptcluster.remote.group import Member, NodeResult, Why, ask_all
from ptcluster.remote.replies import BadReply, sample_reply
from ptcluster.remote.transport import Transport, explain_channel_failure


@dataclass
class NodeView:
    host: str
    sample: Sample | None = None
    error: str | None = None
    updated: float | None = None
    refused: int = 0
    """Samples of the node refused as malformed (``remote.replies.sample_reply``)."""


class Monitor:
    """One sampler channel per node (and spare: a job may run on one after a restart); use as a
    context manager (or call ``close``)."""

    def __init__(self, spec: ClusterSpec, transports: dict[str, Transport],
                 interval: float = 2.0) -> None:
        self.spec = spec
        self.transports = transports
        self.interval = interval
        self.nodes = {n.host: n for n in spec.machines}
        self.views = {n.host: NodeView(host=n.host) for n in spec.machines}
        self.lock = threading.Lock()
        self.gone: dict[str, float] = {}
        """host -> when (monotonic) its session ended or could not start: ``reopen`` tries it
        again."""
        self._session = {n.host: 0 for n in spec.machines}
        """host -> the number of its current session (a late word of an ended one is dropped)."""
        self.channels = start_all([self._channel(n.host) for n in spec.machines],
                                  self._could_not_start)

    def _channel(self, host: str) -> NodeChannel:
        node, session = self.nodes[host], self._session[host]
        config: SamplerConfig = {"interval": self.interval}
        return NodeChannel(self.transports[host], node.python, SAMPLER, config,
                           on_frames=partial(self._frames, host, session),
                           on_closed=partial(self._closed, host, session, node.python))

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _could_not_start(self, channel: NodeChannel, said: Problem) -> None:
        with self.lock:
            self.views[channel.host].error = unreachable(Why.NOT_STARTED, said)
            self.gone.setdefault(channel.host, time.monotonic())

    def _frames(self, host: str, session: int, lines: list[str]) -> None:
        if session != self._session[host]:
            return
        for line in lines:
            kind, payload = split(line)
            if kind != Kind.SAMPLE:
                continue
            with self.lock:
                receive(self.views[host], payload, time.time())

    def _closed(self, host: str, session: int, python: str, code: int | None,
                stderr: list[str]) -> None:
        if session != self._session[host]:
            return
        said = explain_channel_failure(stderr, code, python)
        with self.lock:
            self.views[host].error = unreachable(Why.CLOSED, said)
            self.gone.setdefault(host, time.monotonic())

    def reopen(self, after: float) -> list[str]:
        """A new session to every node whose last one ended (or never started) ``after`` s ago
        or more: a monitor that runs for days (``--serve``) sees a node come back. The node
        stays reported unreachable until its first new sample. Returns the hosts tried."""
        now = time.monotonic()
        with self.lock:
            due = [h for h, at in self.gone.items() if now - at >= after]
            for host in due:
                del self.gone[host]
                self._session[host] += 1
        fresh = [self._channel(h) for h in due]
        self.channels = [c for c in self.channels if c.host not in due]
        self.channels += start_all(fresh, self._could_not_start) if fresh else []
        return due

    def wait_first(self, timeout: float) -> None:
        """Until every node has a sample or an error, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(v.sample is not None or v.error for v in self.snapshot()):
                return
            time.sleep(0.05)
        with self.lock:
            for view in self.views.values():
                if view.sample is None and view.error is None:
                    view.error = f"no sample within {timeout:.0f} s"

    def close(self) -> None:
        close_all(self.channels, timeout=5.0)

    def snapshot(self) -> list[NodeView]:
        with self.lock:
            return [NodeView(v.host, v.sample, v.error, v.updated, v.refused)
                    for v in self.views.values()]


def receive(view: NodeView, payload: str, now: float) -> None:
    """A sample frame's ``payload`` into ``view``: the sample when it passes
    (``remote.replies.sample_reply``), else the node's error, and one more refused."""
    try:
        sample = sample_reply(control(payload))
    except BadReply as exc:
        view.error, view.refused = exc.what, view.refused + 1
    except ValueError as exc:
        view.error, view.refused = f"bad sample from the node: {exc}", view.refused + 1
    else:
        view.sample, view.error, view.updated = sample, None, now


def unreachable(why: Why, said: Problem | None) -> str:
    """The monitor's and ``ps``'s words for a node without a sample: the whole problem when
    its channel could not start, only what went wrong otherwise."""
    if why is Why.NOT_STARTED:
        return str(said or Problem(None, "not started"))
    if why is Why.CLOSED:
        return f"unreachable: {None if said is None else said.what}"
    return "no answer" if said is None else said.what


def sample_once(spec: ClusterSpec, transports: dict[str, Transport], timeout: float,
                interval: float = 0.2) -> tuple[dict[str, Sample], dict[str, str]]:
    """Every node's first sample (its sampler started once: ``ps``), and for each node that
    has none within ``timeout`` s, why."""
    config: SamplerConfig = {"interval": interval}
    members = [Member(n.host, transports[n.host], n.python, config) for n in spec.machines]
    result = ask_all(members, SAMPLER, Kind.SAMPLE, timeout,
                     late=Problem(None, f"no sample within {timeout:.0f} s"))
    samples: dict[str, Sample] = {}
    why = {h: _why_not(r) for h, r in result.failed.items()}
    for host, r in result.succeeded.items():
        try:
            samples[host] = sample_reply(r.answers[Kind.SAMPLE])
        except BadReply as exc:
            why[host] = exc.what
    return samples, why


def _why_not(r: NodeResult) -> str:
    return unreachable(r.why, r.problem) if r.why is not None else "no answer"


def job_straggler(runs: Path) -> dict[str, Any] | None:
    """The straggler report's current figures of the newest job running under ``runs`` (asked
    on its control socket: every rank's wait share, the straggler), None without one."""
    for run_dir in running_jobs(runs)[:1]:
        try:
            answer = ask_straggler(run_dir, timeout=5.0)
        except (PtclusterError, OSError, ValueError):
            return None
        figures = answer.get("straggler") if answer.get("ok") else None
        if figures is None:
            return None
        return {"run_dir": str(run_dir), **{k: v for k, v in figures.items() if k != "trace"}}
    return None


def node_waits(figures: dict[str, Any] | None) -> dict[str, str]:
    """The monitor's cell for each node with ranks: each of its ranks' wait share, the
    straggler marked (one pass over the ranks, whatever the number of nodes)."""
    late = set(((figures or {}).get("current") or {}).get("ranks") or [])
    cells: dict[str, list[str]] = {}
    for r in (figures or {}).get("ranks") or []:
        if not r.get("host"):
            continue
        cells.setdefault(str(r["host"]), []).append(
            f"r{r['rank']} {r['wait_share']:.0%}" + (" straggler" if r["rank"] in late else ""))
    return {host: ", ".join(texts) for host, texts in cells.items()}
