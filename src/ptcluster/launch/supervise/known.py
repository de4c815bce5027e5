"""The failures multi-node users hit most, each with what it means and the fix: one table.

Each entry is matched on the structured facts a rank reports of its own death (the shim's
``error`` record: the exception's type name, its message, its ``errno``, and for an
``argparse`` exit the parser's message) or on the guards' ready facts (the versions of each
node) -- never on torchrun's or a library's log text. ``match_rank`` gives the first entry
that fits a rank's report; ``versions_differ`` the job-level one. Plain data, so that a docs
page is generated from it (``as_markdown``).

An entry marked ``consequence`` (a peer's connection reset or closed, NCCL's remote error) is
what a rank sees when another one died: ``order_failures`` never makes it the root cause when
another failure happened within ``CONSEQUENCE_WINDOW`` of it, whichever was stamped first.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ptcluster.launch.result import Failure

CONSEQUENCE_WINDOW = 1.0
"""Seconds around a consequence within which another failure is taken as its cause. The
kernel closes a dying process's sockets before its parent's ``wait`` returns, so a peer can
stamp its "reset by peer" before the dying rank's exit is stamped: here 0.5 ms before, on one
machine; on two, the clocks' correction adds up to the one-way latency measured at hello (ms).
A second is far above both, and far below the seconds a real network fault and a rank's own,
unrelated death would need to fall together."""


@dataclass(frozen=True)
class Match:
    """What a rank's report must show: every criterion given (within one, any alternative)."""

    types: tuple[str, ...] = ()
    """The exception's type name (``type(exc).__name__``), one of these."""
    text: tuple[str, ...] = ()
    """A substring of the exception's text (its type and message), case-insensitive."""
    errno: tuple[int, ...] = ()
    """The exception's ``errno`` (an ``OSError``'s), one of these."""
    usage: tuple[str, ...] = ()
    """Substrings of the message ``argparse`` exited with (``SystemExit`` 2): every one."""

    def fits(self, report: RankReport) -> bool:
        low, usage = report.text.lower(), report.usage.lower()
        return ((not self.types or report.exc in self.types)
                and (not self.text or any(t.lower() in low for t in self.text))
                and (not self.errno or report.errno in self.errno)
                and all(u.lower() in usage for u in self.usage))

    def describe(self) -> str:
        """The criteria in words (the docs page)."""
        parts = []
        if self.types:
            parts.append("exception " + " or ".join(f"`{t}`" for t in self.types))
        if self.text:
            parts.append("its text has " + " or ".join(f"“{t}”" for t in self.text))
        if self.errno:
            parts.append("errno " + " or ".join(f"{e} ({ERRNO_NAMES[e]})" for e in self.errno))
        if self.usage:
            parts.append("argparse exited with “" + "” and “".join(self.usage) + "”")
        return ", ".join(parts)


@dataclass(frozen=True)
class RankReport:
    """What a rank said of its death, as the table reads it (the shim's ``error`` record)."""

    exc: str
    """The exception's type name; "" when the rank raised nothing (a signal, ``os._exit``)."""
    text: str = ""
    errno: int | None = None
    usage: str = ""
    """``argparse``'s message, when the parser exited."""


@dataclass(frozen=True)
class Known:
    """One known failure: its name (``summary.json``'s ``known``), when it applies, what it
    means and the fix (the root-cause line's)."""

    name: str
    title: str
    when: tuple[Match, ...]
    """Any of these fits a rank's report; none: matched on the nodes' ready facts instead."""
    meaning: str
    fix: str
    consequence: bool = False
    """What a rank sees when another one died: never the root cause beside that death."""


ERRNO_NAMES = {32: "EPIPE", 98: "EADDRINUSE", 101: "ENETUNREACH", 104: "ECONNRESET",
               110: "ETIMEDOUT", 111: "ECONNREFUSED", 113: "EHOSTUNREACH"}
"""Linux's numbers (the nodes run Linux) of the ``errno`` values the table matches."""
EPIPE, EADDRINUSE, ENETUNREACH, ECONNRESET, ETIMEDOUT, ECONNREFUSED, EHOSTUNREACH = ERRNO_NAMES

VERSIONS = Known(
    name="versions-differ", title="torch or NCCL differ between nodes", when=(),
    meaning="the nodes run different builds of torch (or NCCL): the rendezvous, the "
            "collectives and their wire formats may not agree, and the job fails or hangs in "
            "ways that name no cause",
    fix="install the same torch (and NCCL) on every node, from the same index; each node's "
        "versions are in summary.json (nodes: torch, nccl)")
"""Matched on the guards' ready facts (``versions_differ``), for a failure nothing else fits."""

TABLE: tuple[Known, ...] = (
    Known(name="nccl-not-built", title="NCCL not built in",
          when=(Match(text=("doesn't have NCCL built in", "NCCL support is not compiled")),),
          meaning="the job asked for backend nccl, but this node's torch has no NCCL (a CPU "
                  "build of torch)",
          fix="install a CUDA build of torch on every node; on nodes without GPUs, use "
              "gloo: init_process_group('nccl' if torch.cuda.is_available() else 'gloo')"),
    Known(name="invalid-device-ordinal", title="invalid device ordinal",
          when=(Match(text=("invalid device ordinal",)),),
          meaning="the rank asked for a GPU index its node does not have: usually the global "
                  "RANK used as the device, which on a second node is past its GPUs",
          fix="pick the device by the local rank: torch.cuda.set_device(int(os.environ"
              "['LOCAL_RANK'])) and DDP(model, device_ids=[local_rank]); keep `slots:` at "
              "most the node's GPUs"),
    Known(name="cuda-out-of-memory", title="CUDA out of memory",
          when=(Match(types=("OutOfMemoryError",)), Match(text=("CUDA out of memory",))),
          meaning="the rank's GPU had no memory left for an allocation",
          fix="lower the per-GPU batch (keep the global batch with gradient accumulation), use "
              "mixed precision or activation checkpointing; check that no other process holds "
              "memory on that GPU; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True helps "
              "against fragmentation"),
    Known(name="collective-timeout", title="a collective timed out (NCCL's watchdog)",
          when=(Match(text=("Watchdog caught collective operation timeout",
                            "milliseconds before timing out", "Timed out waiting")),),
          meaning="a collective did not complete within the process group's timeout: another "
                  "rank never joined it (it died, hung, took another code path, or is far "
                  "slower: rank 0 alone saving or evaluating)",
          fix="find the rank that did not join (the earliest other failure, or `run "
              "--hang-timeout S` for every rank's stack); make every rank call the same "
              "collectives in the same order; raise init_process_group(timeout=...) for long "
              "work done by one rank"),
    Known(name="peer-gone", title="a peer's connection was reset or closed", consequence=True,
          when=(Match(text=("Connection reset by peer", "Connection closed by peer",
                            "Broken pipe", "ncclRemoteError", "remote process exited",
                            "failed to recv, got 0 bytes")),
                Match(errno=(ECONNRESET, EPIPE))),
          meaning="the rank lost its connection to a peer: the peer's process ended (the "
                  "kernel closed its sockets) or the network between them failed",
          fix="look at the rank that ended at about the same time: its failure is the cause "
              "(when one did, it is the root cause, not this); if none did, check the network "
              "between the nodes (`ptcluster doctor`)"),
    Known(name="address-in-use", title="address already in use",
          when=(Match(errno=(EADDRINUSE,)),
                Match(text=("EADDRINUSE", "address already in use"))),
          meaning="a port the rank listens on is taken on its node: by another job, a previous "
                  "run's leftover, or a fixed port the script chose itself",
          fix="let ptcluster choose the port (`master.port: auto`, or `run --port` with a free "
              "one) and set no init_method or MASTER_PORT in the script (init_process_group "
              "reads what ptcluster sets); `ptcluster ps` lists the jobs on the node"),
    Known(name="rendezvous-unreachable", title="the rendezvous cannot be reached",
          when=(Match(errno=(ECONNREFUSED, ETIMEDOUT, EHOSTUNREACH, ENETUNREACH)),
                Match(text=("while trying to connect to", "Connection refused",
                            "No route to host", "Network is unreachable",
                            "waiting for clients"))),
          meaning="the node could not reach the rendezvous (torchrun's store on the first "
                  "node) or a peer, or the first node waited in vain for the others: a "
                  "firewall drops or refuses the port, the address is not routable from the "
                  "node, or nothing listens there any more",
          fix="open the rendezvous port, and the ports NCCL and gloo pick, between the nodes "
              "(or trust their subnet: `ufw allow from SUBNET`); check that master.addr is the "
              "first node's address on this network; `ptcluster doctor` checks ports and "
              "routes"),
    Known(name="module-missing", title="a module is missing on a node",
          when=(Match(types=("ModuleNotFoundError",)),),
          meaning="the script imports a module this node's python cannot find: the project's "
                  "own code not copied there, or a package not installed in that python",
          fix="`ptcluster run --sync ...` copies the project to every node's workdir first; "
              "a missing package: list it in the project's requirements (`run --requirements "
              "FILE`, or `requirements:` in the cluster file), and every node builds it into "
              "the job's environment before a rank starts"),
    Known(name="local-rank-arg-underscore", title="the script wants --local_rank",
          when=(Match(types=("SystemExit",), usage=("arguments are required", "--local_rank")),),
          meaning="the script was written for `python -m torch.distributed.launch`, which "
                  "passed --local_rank=N to every process before torch 2.0; torchrun and "
                  "ptcluster set LOCAL_RANK in the environment instead",
          fix="`ptcluster run --local-rank-arg underscore ...` passes --local_rank=N as that "
              "launcher did; or read int(os.environ['LOCAL_RANK']) in the script"),
    Known(name="local-rank-arg-dash", title="the script wants --local-rank",
          when=(Match(types=("SystemExit",), usage=("arguments are required", "--local-rank")),),
          meaning="the script was written for `python -m torch.distributed.launch`, which "
                  "passes --local-rank=N to every process (torch 2.0 and later); torchrun and "
                  "ptcluster set LOCAL_RANK in the environment instead",
          fix="`ptcluster run --local-rank-arg dash ...` passes --local-rank=N as that "
              "launcher does; or read int(os.environ['LOCAL_RANK']) in the script"),
    Known(name="local-rank-arg-spelling", title="the script parses the other spelling",
          when=(Match(types=("SystemExit",), usage=("unrecognized arguments", "--local")),),
          meaning="the script got the local rank as an argument it does not parse: "
                  "--local-rank=N (`--local-rank-arg dash`) for a parser of --local_rank, or "
                  "the other way round",
          fix="pass the other `--local-rank-arg` (underscore: --local_rank=N, dash: "
              "--local-rank=N), or parse both: add_argument('--local-rank', '--local_rank', "
              "type=int)"),
    VERSIONS,
)
"""In order: the first entry that fits a rank's report wins."""
CONSEQUENCES = frozenset(k.name for k in TABLE if k.consequence)
BY_NAME = {k.name: k for k in TABLE}


def match_rank(report: RankReport) -> Known | None:
    """The first entry that fits what a rank reported of its death; None: none does."""
    if not report.exc:
        return None
    return next((k for k in TABLE if any(m.fits(report) for m in k.when)), None)


def match_agent(error: str) -> Known | None:
    """The entry for torchrun's own failure, ``TYPE: TEXT`` as its error file gives it."""
    exc, sep, _ = error.partition(": ")
    return match_rank(RankReport(exc if sep and exc.isidentifier() else "?", error)) \
        if error else None


def differing_versions(facts: Mapping[str, Mapping[str, object]]) -> dict[str, dict[str, str]]:
    """``{"torch": {"n1": "2.4.0", "n2": "2.5.1"}}``: each of ``torch``, ``nccl`` whose
    versions the nodes' ready facts name differently, with every node's; {} where they agree
    or say nothing."""
    out = {}
    for what in ("torch", "nccl"):
        seen = {host: str(f[what]) for host, f in facts.items() if f.get(what)}
        if len(set(seen.values())) > 1:
            out[what] = seen
    return out


def versions_said(differ: Mapping[str, Mapping[str, str]]) -> str | None:
    """``n1: torch 2.4.0, n2: torch 2.5.1``: :func:`differing_versions` in words (None: {})."""
    return "; ".join(", ".join(f"{host}: {what} {v}" for host, v in seen.items())
                     for what, seen in differ.items()) or None


def versions_differ(facts: Mapping[str, Mapping[str, object]]) -> str | None:
    """``n1: torch 2.4.0, n2: torch 2.5.1`` where the nodes' ready facts (``torch``,
    ``nccl``) name different versions; None where they agree or say nothing."""
    return versions_said(differing_versions(facts))


def order_failures(failures: Iterable[Failure]) -> list[Failure]:
    """Every failure, earliest first (a rank's before a node's at the same time), except that
    a consequence (``CONSEQUENCES``) within ``CONSEQUENCE_WINDOW`` of another failure comes
    right after it: that one is its cause, whichever was stamped first."""
    ordered = sorted(failures, key=lambda f: (f.at, f.rank is None))
    causes = [f.at for f in ordered if f.known not in CONSEQUENCES]

    def key(f: Failure) -> tuple[float, int, bool]:
        if f.known in CONSEQUENCES:
            i = bisect.bisect_left(causes, f.at - CONSEQUENCE_WINDOW)
            if i < len(causes) and causes[i] <= f.at + CONSEQUENCE_WINDOW:
                return (max(f.at, causes[i]), 1, f.rank is None)
        return (f.at, 0, f.rank is None)
    return sorted(ordered, key=key)


def as_markdown(table: Sequence[Known] = TABLE) -> str:
    """The docs page: every entry with when it applies, what it means and the fix."""
    lines = ["# Known failures", "",
             "What `ptcluster run` recognises in a rank's own report of its death (never in "
             "log text), and the fix it prints on the root-cause line (`summary.json`: "
             "`known`, `fix`).", ""]
    for k in table:
        when = "; or ".join(m.describe() for m in k.when) or \
            "the nodes' ready facts name different versions, and nothing else fits the failure"
        lines += [f"## {k.title} (`{k.name}`)", "", f"- **When**: {when}.",
                  f"- **Meaning**: {k.meaning}.", f"- **Fix**: {k.fix}."]
        if k.consequence:
            lines.append(f"- **A consequence**: never the root cause when another failure "
                         f"happened within {CONSEQUENCE_WINDOW:g} s of it.")
        lines.append("")
    return "\n".join(lines)
