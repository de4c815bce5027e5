"""The project's environment onto every node, in parallel: ask each what it has, send only the
wheels it lacks, build where the environment is missing or changed (``node.venv_agent``).

One ``remote.group.Group`` of the ``venvs`` program: the same channels, window and per-node
outcomes as doctor's. The wheels travel raw on each node's channel after a ``blob`` frame (the
one way every connector has; ``remote.blobs``, shared with ``ptcluster push``), from this one
thread, and each node's ``build`` right behind its last wheel (its build starts as soon as its
own wheels are in, not after every node's). From ``remote.relay.RELAY_MIN`` nodes they relay
as push's files do (``remote.relay``: head -> n1 -> n2 -> ..., the head sending each wheel
once, to n1, each node storing it and passing it on); a node the chain failed (its upstream
gone) gets what it still lacks from the head, then builds. Else each missing wheel goes once
to each node. The library only yields events (``on_event(host, text)``); ``cli/`` prints them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ptcluster.errors import Problem
from ptcluster.node import VENVS
from ptcluster.node.wire import HEARTBEAT_EVERY, HEARTBEAT_TIMEOUT, Kind
from ptcluster.remote.blobs import Blob, Outgoing, stream
from ptcluster.remote.group import Group, Member
from ptcluster.remote.relay import RELAY_MIN, address, relayed
from ptcluster.venvs.problems import MACHINE_DIFFERS, PYTHON_DIFFERS
from ptcluster.venvs.resolve import check_torch
from ptcluster.venvs.resolved import Platform, ResolvedEnv, Wheel

if TYPE_CHECKING:  # (the node program's own imports are not the head's: ~6 ms of every run)
    from ptcluster.node.venv_agent import VenvsConfig

SENDING, BUILDING = "sending", "building"


@dataclass(frozen=True)
class Progress:
    """One node's step, as it happens: ``sending`` (``sent`` of ``total`` bytes), ``building``,
    then its outcome (``final``: one per node; the only ones worth a line where no terminal
    shows a live one)."""

    host: str
    state: str
    text: str
    sent: int = 0
    total: int = 0
    final: bool = False


Event = Callable[[Progress], None]
Choose = Callable[[Platform], ResolvedEnv]
"""The environment resolved for a node's platform (``venvs.resolve.resolve``, one call per
distinct platform): may raise a ``PtclusterError`` (nothing is sent then)."""
Locate = Callable[[Wheel], Path]
"""Where the head's store keeps a wheel's file (``venvs.store.WheelStore.path``)."""
NODE_ROOT = "~/.ptcluster"
"""The user's ptcluster directory on every node (``node.venv_store`` says what is in it)."""
HAVE_TIMEOUT = 60.0
BUILD_TIMEOUT = 1800.0
UP_TO_DATE, BUILT, REBUILT, FAILED = "up to date", "built", "rebuilt", "failed"


@dataclass(frozen=True)
class NodeEnv:
    """One node's outcome."""

    host: str
    state: str
    """``up to date`` (nothing done), ``built``, ``rebuilt`` (it failed the cheap check:
    ``why``), ``failed`` (``problem``)."""
    digest: str = ""
    """The environment's key on this node (one per distinct platform)."""
    python: str | None = None
    """The environment's interpreter there: the ranks' interpreter (absolute as the node said
    it; ``~/``-relative where the head launched without asking, ``runenv.expect``)."""
    wheels_sent: int = 0
    """By the head itself."""
    bytes_sent: int = 0
    wheels: int = 0
    """The wheels it lacked (sent by the head, or passed on by the node before it in the
    relay)."""
    seconds: float = 0.0
    """The node's build time (0 when none)."""
    why: str = ""
    problem: Problem | None = None
    torch: str = ""
    """Where the head launched without asking (``runenv.expect``): the torch it remembers of
    the node, which the lock was checked against and the guard checks again ("" after a ship:
    checked then)."""


@dataclass(frozen=True)
class ShipResult:
    nodes: dict[str, NodeEnv]
    envs: dict[str, ResolvedEnv]
    """Every environment resolved, by digest."""
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each answering node's ``facts`` (its platform, the torch and ptcluster beneath):
    what the head remembers to launch the next time without asking (``venvs.known``)."""

    @property
    def failed(self) -> dict[str, NodeEnv]:
        return {h: n for h, n in self.nodes.items() if n.problem is not None}

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def digest(self) -> str:
        """The environment's digest (the nodes' platforms' digests joined, where several)."""
        return ",".join(sorted(self.envs))

    chain: list[str] = field(default_factory=list)
    """The relay's nodes in order (empty: the head sent each node its wheels)."""

    @property
    def bytes_sent(self) -> int:
        """The head's egress of wheels: every byte it sent, to every node."""
        return sum(n.bytes_sent for n in self.nodes.values())


def wheel_json(w: Wheel) -> dict[str, Any]:
    return {"name": w.name, "version": w.version, "filename": w.filename, "sha256": w.sha256,
            "size": w.size}


def node_record(env: ResolvedEnv) -> dict[str, Any]:
    """The resolved set as the node keeps it (``ptcluster-env.json``'s ``resolved``): the
    fields ``node.venv_agent`` reads, spelled here (not ``ResolvedEnv.to_json``, the run
    dir's record, whose shape is the resolver's)."""
    p = env.platform
    return {"source": env.source, "kind": env.kind, "digest": env.digest,
            "platform": {"python": p.python, "machine": p.machine, "glibc": p.glibc},
            "wheels": [wheel_json(w) for w in env.wheels],
            "tools": [wheel_json(w) for w in env.tools]}


def platform_problem(host: str, env: ResolvedEnv, have: dict[str, Any]) -> Problem | None:
    """A node whose interpreter or machine is not the environment's: refused before a byte."""
    want = env.platform
    if have.get("python") != want.python:
        return Problem.of(PYTHON_DIFFERS, host, have=have.get("python"), source=env.source,
                          want=want.python)
    if have.get("machine") != want.machine:
        return Problem.of(MACHINE_DIFFERS, host, have=have.get("machine"), want=want.machine)
    return None


def ship(members: Sequence[Member[VenvsConfig]], choose: Choose, locate: Locate, *,
         on_event: Event | None = None, have_timeout: float = HAVE_TIMEOUT,
         build_timeout: float = BUILD_TIMEOUT, relay: bool | None = None) -> ShipResult:
    """The environment ``choose`` resolves for each node's platform, on every member (its
    ``config``: ``{"root": ...}``, default :data:`NODE_ROOT`; ``"addr"``: where the other
    nodes reach it, default as the head resolves its host): every node's outcome, a failed
    node named with its problem, the others' work kept. ``relay`` (default: from
    ``RELAY_MIN`` nodes): the nodes pass the wheels on to each other. Raises what ``choose``
    raises (every channel closed first, nothing sent)."""
    say = on_event or (lambda progress: None)
    # heartbeats: a node whose link is cut mid-build sees no EOF (its sshd keeps the session
    # for as long as TCP does); the program ends itself after HEARTBEAT_TIMEOUT s of silence
    relaying = len(members) >= RELAY_MIN if relay is None else relay
    members = [replace(m, config=_config(m, relaying)) for m in members]
    group = Group(members, VENVS, answer=Kind.BUILD,
                  kinds=(Kind.FACTS, Kind.HAVE, Kind.RELAY, Kind.LINK), heartbeat=HEARTBEAT_EVERY)
    out: dict[str, NodeEnv] = {}
    envs: dict[str, ResolvedEnv] = {}
    chain: list[str] = []
    finished = False
    try:
        group.wait(Kind.FACTS, have_timeout)
        by_host = _resolve(group, choose)
        envs = {e.digest: e for e in by_host.values()}
        sending = _have(group, by_host, list(by_host), out, say, locate, have_timeout)
        wanted = {h: len(s.blobs) for h, s in sending.items()}
        chain, sending = relayed(group, members, sending, relaying)
        answers = _build(group, by_host, sending, say, build_timeout)
        again = [h for h, a in answers.items() if chain and a and a.get("lacking")
                 and group.alive(h)]
        if again:  # (the chain failed them: the head sends each what it still lacks)
            for host in again:
                del answers[host]
            more = _have(group, by_host, again, out, say, locate, have_timeout)
            answers.update(_build(group, by_host, more, say, build_timeout))
            answers.update({h: None for h in again if h not in out and h not in answers})
            sending.update({h: _sum(sending[h], s) for h, s in more.items()})
        for host, built in answers.items():
            out[host] = _built(host, by_host[host].digest, built, sending[host], wanted[host]) \
                if built is not None else NodeEnv(host, FAILED, bytes_sent=sending[host].sent)
            say(Progress(host, out[host].state, _line(out[host]), out[host].bytes_sent,
                         out[host].bytes_sent, final=True))
        finished = True
    finally:
        result = group.close(bye=Kind.BYE if finished else None)
    for host, r in result.nodes.items():
        node = out.get(host)
        if node is None or (node.state == FAILED and node.problem is None):
            problem = (r.problem or Problem(None, "no answer", None)).by(host)
            out[host] = NodeEnv(host, FAILED, problem=problem,
                                bytes_sent=node.bytes_sent if node else 0)
            say(Progress(host, FAILED, f"failed: {problem.what}", final=True))
    facts = {h: dict(r.answers[Kind.FACTS]) for h, r in result.nodes.items()
             if r.answers.get(Kind.FACTS) is not None}
    return ShipResult({m.host: out[m.host] for m in members}, envs, facts, chain)


def _config(member: Member[VenvsConfig], relaying: bool) -> VenvsConfig:
    """The member's config with ship's defaults beneath it: the heartbeats' ``silence`` and,
    when ``relaying``, the address the other nodes reach it at."""
    config: VenvsConfig = {"silence": HEARTBEAT_TIMEOUT, **member.config}
    if relaying:
        config.setdefault("addr", address(member.host))
    return config


def _have(group: Group, by_host: dict[str, ResolvedEnv], hosts: list[str],
          out: dict[str, NodeEnv], say: Event, locate: Locate,
          timeout: float) -> dict[str, Outgoing]:
    """Ask ``hosts`` what they have: what to send each (the up to date and the refused in
    ``out``)."""
    for host in hosts:
        env = by_host[host]
        group.result.nodes[host].answers.pop(Kind.HAVE, None)
        group.send(host, Kind.HAVE, {"digest": env.digest,
                                     "wheels": [w.sha256 for w in (*env.wheels, *env.tools)]})
    group.wait(Kind.HAVE, timeout, hosts=hosts)
    return _plan(group, {h: by_host[h] for h in hosts}, out, say, locate)


def _build(group: Group, by_host: dict[str, ResolvedEnv], sending: dict[str, Outgoing],
           say: Event, timeout: float) -> dict[str, dict[str, Any] | None]:
    """``sending``'s wheels, each node's ``build`` behind its last one (a node the head sends
    nothing, the relay's: behind every node's), and every node's answer (None: none)."""
    building: list[str] = []

    def build(host: str) -> None:
        building.append(host)
        group.result.nodes[host].answers.pop(Kind.BUILD, None)
        group.send(host, Kind.BUILD, {"digest": by_host[host].digest,
                                      "resolved": node_record(by_host[host])})
    _stream(group, sending, say, build)
    for host in sending:
        if host not in building and group.alive(host):
            build(host)
    group.wait(Kind.BUILD, timeout, hosts=building)
    return {h: group.result.nodes[h].answers.get(Kind.BUILD) for h in sending}


def _sum(a: Outgoing, b: Outgoing) -> Outgoing:
    """What went to a node in two rounds (the relay's, then the head's)."""
    return Outgoing(deque(), a.total + b.total, a.sent + b.sent, a.count + b.count)


def _resolve(group: Group, choose: Choose) -> dict[str, ResolvedEnv]:
    """Each answering node's environment, resolved once per distinct platform."""
    memo: dict[Platform, ResolvedEnv] = {}
    out = {}
    for host, r in group.result.nodes.items():
        facts = r.answers.get(Kind.FACTS)
        if facts is None:
            continue
        platform = Platform(str(facts["python"]), str(facts["machine"]), str(facts["glibc"]))
        if platform not in memo:
            memo[platform] = choose(platform)
        if facts.get("torch"):  # a lock's torch (or ptcluster) must be what the nodes have
            check_torch(memo[platform].held, str(facts["torch"]),
                        str(facts.get("ptcluster") or "") or None)
        out[host] = memo[platform]
    return out


def _plan(group: Group, by_host: dict[str, ResolvedEnv], out: dict[str, NodeEnv],
          say: Event, locate: Locate) -> dict[str, Outgoing]:
    """From every node's ``have``: those up to date (in ``out``), those refused (in ``out``),
    and what to send the others."""
    sending = {}
    for host, env in by_host.items():
        have = group.result.nodes[host].answers.get(Kind.HAVE)
        if have is None:
            continue
        everything = {w.sha256: w for w in (*env.wheels, *env.tools)}
        wrong = platform_problem(host, env, have)
        if wrong is not None:
            out[host] = NodeEnv(host, FAILED, env.digest, problem=wrong)
            say(Progress(host, FAILED, f"failed: {wrong.what}", final=True))
        elif have["env"] == "ok":
            out[host] = NodeEnv(host, UP_TO_DATE, env.digest, python=str(have["path"]))
            say(Progress(host, UP_TO_DATE, "environment up to date", final=True))
        else:
            missing = [everything[s] for s in have["missing"] if s in everything]
            sending[host] = state = Outgoing.of([
                Blob(locate(w), w.size, {"sha256": w.sha256, "size": w.size}) for w in missing])
            why = f" ({have['why']})" if have["why"] else ""
            say(Progress(host, SENDING, f"environment {have['env']}{why}: {len(missing)} of "
                         f"{len(everything)} wheels to send", 0, state.total))
    return sending


def _built(host: str, digest: str, answer: dict[str, Any], sent: Outgoing,
           wanted: int) -> NodeEnv:
    if not answer.get("ok"):
        return NodeEnv(host, FAILED, digest, bytes_sent=sent.sent, wheels_sent=sent.count,
                       wheels=wanted, problem=Problem.received(host, answer))
    state = (REBUILT if answer.get("rebuilt_why") else BUILT) if answer.get("built") \
        else UP_TO_DATE
    return NodeEnv(host, state, digest, python=str(answer["python"]), wheels_sent=sent.count,
                   bytes_sent=sent.sent, wheels=wanted, seconds=float(answer.get("seconds") or 0),
                   why=str(answer.get("rebuilt_why") or ""))


def _line(node: NodeEnv) -> str:
    if node.problem is not None:
        return f"failed: {node.problem.what}"
    relayed = "" if node.wheels_sent >= node.wheels else \
        f" ({node.wheels - node.wheels_sent} passed on by another node)"
    sent = f"{node.wheels_sent} wheels ({node.bytes_sent / 1e6:.1f} MB) sent{relayed}"
    if node.state == UP_TO_DATE:
        return f"{sent}; environment up to date (another build finished it)"
    return f"{sent}; environment {node.state} in {node.seconds:.1f} s" + (
        f" ({node.why})" if node.why else "")


def _stream(group: Group, sending: dict[str, Outgoing], say: Event,
            build: Callable[[str], None]) -> None:
    """Every node's missing wheels (``remote.blobs``), ``build(host)`` once a node's last byte
    is queued; a node whose channel ended is dropped (its outcome says why)."""

    def tick(host: str, s: Outgoing) -> None:
        say(Progress(host, SENDING, f"{s.sent / 1e6:.1f} of {s.total / 1e6:.1f} MB sent",
                     s.sent, s.total))

    def finished(host: str, s: Outgoing) -> None:
        say(Progress(host, BUILDING, f"{s.count} wheels ({s.sent / 1e6:.1f} MB) sent; "
                     "building", s.sent, s.total))
        build(host)

    stream(group, sending, tick=tick, finished=finished)
