"""The vocabulary of ``ptcluster setup``: a step's status, its commands, the step itself, what
every node's plan may depend on (``ClusterFacts``) and a step's declaration (``StepDef``).

Below ``setup.plan`` (setup's own steps), ``setup.slurm_steps`` (Slurm's) and ``setup.apply``
(which runs them): each imports this, none of them the other's internals.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ptcluster.errors import Problem
from ptcluster.node.facts.setup_facts import SetupFacts
from ptcluster.setup.slurm import SlurmCluster
from ptcluster.setup.torch_choice import TorchChoice

WHEELHOUSE = "~/.ptcluster/wheelhouse"
"""Where a node keeps the wheels the head copied to it."""


class Status(str, Enum):
    """A step's status in a plan (a ``str`` enum: the JSON and the table show the value)."""

    OK = "ok"
    """Its fact proves it done."""
    CHANGE = "change"
    """Apply runs its commands."""
    BLOCKED = "blocked"
    """It cannot be done from here: why, and the commands an admin can run instead."""

    def __str__(self) -> str:
        return self.value


OK, CHANGE, BLOCKED = Status.OK, Status.CHANGE, Status.BLOCKED


@dataclass(frozen=True)
class StepAction:
    """One command of a setup step: on the node over the setup channel, or a copy from the
    head."""

    argv: tuple[str, ...]
    kind: str = "node"
    """``node``: run on the node; ``copy``: the head copies ``argv`` (wheel names) over ssh."""
    root: bool = False
    input: str | None = field(default=None, repr=False)
    """Data for the command's stdin (file contents, the munge key; never a password): never in
    a repr, a display or the JSON (``show_input``: files the plan shows)."""
    timeout: float = 600.0
    env: tuple[tuple[str, str], ...] = ()
    show_input: bool = False
    """The input is a file the plan shows (``--dry-run``); else only its line count is."""

    def display(self, host: str = "NODE") -> str:
        if self.kind == "copy":
            return (f"tar -C <head wheelhouse> -cf - {shlex.join(self.argv)} | ssh {host} "
                    f"'mkdir -p {WHEELHOUSE} && tar -C {WHEELHOUSE} -xf -'")
        argv = (["env", *[f"{k}={v}" for k, v in self.env]] if self.env else []) + [*self.argv]
        text = ("sudo " if self.root else "") + shell_words(argv)
        if self.input is not None:
            text += f"  # stdin: {len(self.input.splitlines())} lines"
        return text


def shell_words(argv: list[str]) -> str:
    """``argv`` as a shell would need it typed, with a leading ``~/`` left bare (the node's
    home, as the node program expands it)."""
    return " ".join("~/" + shlex.quote(w[2:]) if w.startswith("~/") and len(w) > 2 else
                    shlex.quote(w) for w in argv)


@dataclass(frozen=True)
class Step:
    name: str
    status: Status
    why: str = ""
    """What the plan says of it: its reason's what (``problem``), or the facts that prove it
    done (ok: in words)."""
    actions: tuple[StepAction, ...] = ()
    problem: Problem | None = None
    """Why it is a change or blocked, declared (``setup.problems``: its code and fields);
    None for a step that is done."""

    def commands(self, host: str = "NODE") -> list[str]:
        return [a.display(host) for a in self.actions]

    def files(self) -> list[str]:
        """The inputs that are files to show (``StepAction.show_input``), in action order."""
        return [a.input for a in self.actions if a.show_input and a.input is not None]

    def to_json(self, host: str = "NODE") -> dict[str, Any]:
        said = self.problem
        out = {"step": self.name, "status": self.status, "why": self.why,
               "code": None if said is None else said.code,
               "fields": {} if said is None else said.fields, "commands": self.commands(host)}
        if self.files():
            out["files"] = self.files()
        return out


@dataclass(frozen=True)
class ClusterFacts:
    """What every node's plan may depend on beyond its own facts."""

    pubkey: str
    torch: TorchChoice
    self_version: str
    """The ptcluster version the nodes get (``wheels.self_version``)."""
    python: str
    """The head's Python (major.minor): the wheels are for it."""
    addrs: dict[str, str]
    """host -> cluster address (as the head reaches it)."""
    hostnames: dict[str, str]
    """host -> the node's own hostname (nodes whose facts are known)."""
    master_addr: str
    """MASTER_ADDR as ``ptcluster run`` sets it (the cluster file's master address)."""
    master_port: int
    interfaces: dict[str, str | None] = field(default_factory=dict)
    """host -> interface from the cluster file (None: the node's route to the master)."""
    manifest: dict[str, str] | None = None
    """The head's wheelhouse {file: sha256}; None until it has been prepared."""
    slurm: SlurmCluster | None = None
    """``setup --slurm``: the cluster's Slurm (``setup.slurm``); None: no Slurm steps."""


PlanFn = Callable[[str, SetupFacts, ClusterFacts], Step]
"""How a step is planned: ``(host, the node's facts, the cluster's) -> Step``, pure."""


@dataclass(frozen=True)
class StepDef:
    """One setup step, declared once: its name, the facts it needs, the function that plans it
    (as a pyinfra operation declares its facts beside its function)."""

    name: str
    """As the plan, the table and the JSON name the step."""
    sections: tuple[str, ...]
    """The node's fact sections (``facts {"only": [...]}``) apply reads again right before it acts
    on this step; none for a step that only reports (never a change)."""
    plan: PlanFn
    """``(host, the node's facts, the cluster's) -> Step``: pure."""
    wheelhouse: bool = False
    """Its commands name wheels of the head's wheelhouse: when the step is a change, apply
    prepares the wheelhouse (once, for every node) and plans the step again with its manifest."""
    phase: int = 1
    """2: applied once every node's phase 1 is done (a step whose plan needs what phase 1
    made on every node: ``setup.slurm``'s files need every node's slurmd)."""


