"""What a node may say, checked where the head receives it: the schema of setup's ``facts``
replies.

Node programs write these replies; the head decides what it believes. A node's facts shape files
that root writes on *every* node (``slurm.conf``, ``gres.conf``, ``/etc/hosts``), so a reply is
checked once, as it arrives (``setup.login.NodeSession.ask``), before any part of setup reads it:
types, ranges, a hostname that is a DNS name, GPU device files by their pattern, and only the
sections that were asked for (a reply's other keys are dropped, never merged into what the head
already holds). A reply that fails is that node's failure, said in one line.

It lives head-side (``remote/``, beside the channel) and not in ``node/``: the node programs
only write replies, and a check shipped to the node would be the node's word about itself. Other
readers of node replies can add their schema here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, cast

from ptcluster.cluster.validate import is_dns_name
from ptcluster.errors import Problem
from ptcluster.node.facts.setup_facts import SetupFacts, sections
from ptcluster.node.facts.slurm_facts import HW_KEYS, SERVICES, SLURM_FILES, SLURM_PACKAGES
from ptcluster.node.problems import Declared
from ptcluster.node.setup_agent import StepDone
from ptcluster.node.sharing.records import MAX_LEASES, MOST_TEXT, sampled
from ptcluster.node.wire import Sample
from ptcluster.remote.diagnoses import (
    ANSWER_REFUSED,
    FACTS_REFUSED,
    HOSTNAME_REFUSED,
    SAMPLE_REFUSED,
)

GPU_FILE = re.compile(r"/dev/nvidia\d{1,4}")
"""A GPU's device file in ``gres.conf`` (``re.fullmatch``: a trailing newline does not pass)."""
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_TEXT = 1 << 20
"""Longest string in a reply (a file's text: ``/etc/hosts``, the old ``slurm.conf``)."""
MAX_WORD = 4096
"""Longest one-line string (names, paths, versions)."""
MAX_GPUS = 1024
MAX_HW = 1 << 40
"""Bound on each ``slurmd -C`` number (RealMemory is in MiB)."""

IDENTITY = ("user", "uid", "home", "hostname", "python", "python_path", "sudo")
"""Keys of every facts reply (``node.setup_agent.Node.facts``)."""
SECTION_KEYS: dict[str, tuple[str, ...]] = {
    "apt": ("packages",), "venv": ("venv",), "key": ("key_authorized",), "os": ("os", "gpu"),
    "firewall": ("firewall",), "wheels": ("wheelhouse",), "hosts": ("hosts",),
    "workdir": ("workdir",), "env": ("env_file", "interface", "interface_why"),
    "slurm": ("slurm",),
}
"""The reply keys of each section (``node.facts.setup_facts.SECTIONS``)."""


class BadReply(ValueError):
    """A reply the head does not believe: what is wrong with it, and the fix; ``problem``:
    the same, declared (``remote.diagnoses.REPLIES``: its code and fields)."""

    def __init__(self, entry: Declared, **values: object) -> None:
        self.problem = Problem.of(entry, None, **values)
        super().__init__(self.problem.what)

    @property
    def what(self) -> str:
        return self.problem.what

    @property
    def fix(self) -> str:
        return self.problem.fix or ""

    def said_of(self, entry: Declared) -> BadReply:
        """The same refused value said of another kind of reply (``entry``: the doctor's
        facts, a node program's answer, a sample); a refusal of another kind, as it was."""
        if self.problem.code != FACTS_REFUSED.code:
            return self
        return BadReply(entry, **self.problem.fields)


Check = Callable[[str, Any], None]


def checked(schema: Check, what: str, value: Any, entry: Declared) -> Any:
    """``value``, which ``schema`` passes (``what``: where a refusal says it is). Raises
    :class:`BadReply`, said as ``entry`` (the kind of reply it came in)."""
    try:
        schema(what, value)
    except BadReply as exc:
        raise exc.said_of(entry) from None
    return value


def _bad(where: str, value: object, want: str) -> BadReply:
    return BadReply(FACTS_REFUSED, where=where, value=_shown(value), want=want)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def word(where: str, value: Any) -> None:
    """One line of printable text."""
    if not isinstance(value, str) or len(value) > MAX_WORD or CONTROL.search(value):
        raise _bad(where, value, "one line of text")


def text(where: str, value: Any) -> None:
    """A file's text (lines allowed), or None."""
    if value is not None and (not isinstance(value, str) or len(value) > MAX_TEXT):
        raise _bad(where, value, "a file's text")


def optional(check: Check) -> Check:
    def either(where: str, value: Any) -> None:
        if value is not None:
            check(where, value)
    return either


def boolean(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _bad(where, value, "true or false")


def number(low: int, high: int) -> Check:
    """An int in ``[low, high]`` (a bool is not one)."""
    def check(where: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise _bad(where, value, f"a whole number from {low} to {high}")
    return check


def one_of(*allowed: str) -> Check:
    def check(where: str, value: Any) -> None:
        if value not in allowed:
            raise _bad(where, value, " or ".join(repr(a) for a in allowed))
    return check


def mapping(values: Check, keys: tuple[str, ...] | None = None) -> Check:
    """A dict of word keys (exactly ``keys`` when given) whose values pass ``values``."""
    def check(where: str, value: Any) -> None:
        if not isinstance(value, dict) or (keys is not None and set(value) != set(keys)):
            raise _bad(where, value, "a table" + (f" of {', '.join(keys)}" if keys else ""))
        for k, v in value.items():
            word(f"{where} key", k)
            values(f"{where}.{k}", v)
    return check


class Record:
    """A check of a dict with these keys (each checked; a missing key counts as None), and no
    other; ``fields`` says which (a test compares them with the writer's TypedDict)."""

    def __init__(self, fields: dict[str, Check]) -> None:
        self.fields = fields

    def __call__(self, where: str, value: Any) -> None:
        if not isinstance(value, dict) or not set(value) <= set(self.fields):
            raise _bad(where, value, "a table of " + ", ".join(self.fields))
        for k, field in self.fields.items():
            field(f"{where}.{k}", value.get(k))


def record(fields: dict[str, Check]) -> Record:
    """:class:`Record` of ``fields``."""
    return Record(fields)


def listing(items: Check, most: int) -> Check:
    def check(where: str, value: Any) -> None:
        if not isinstance(value, list) or len(value) > most:
            raise _bad(where, value, f"a list of at most {most}")
        for i, item in enumerate(value):
            items(f"{where}[{i}]", item)
    return check


def loose(where: str, value: Any) -> None:
    """A value the plan only compares or shows (never writes into a file): any JSON, its
    strings bounded."""
    if isinstance(value, str):
        text(where, value)
    elif isinstance(value, dict):
        mapping(loose)(where, value)
    elif isinstance(value, list):
        listing(loose, 100_000)(where, value)
    elif value is not None and not isinstance(value, (bool, int, float)):
        raise _bad(where, value, "JSON")


def hostname(where: str, value: Any) -> None:
    if not is_dns_name(value):
        raise BadReply(HOSTNAME_REFUSED, hostname=str(value)[:80])


def gpu_file(where: str, value: Any) -> None:
    if not isinstance(value, str) or not GPU_FILE.fullmatch(value):
        raise _bad(where, value, "a GPU's device file (/dev/nvidiaN)")


GPU = record({"count": number(0, MAX_GPUS), "driver": optional(word),
              "compute_capability": listing(loose, MAX_GPUS)})
SLURM = record({
    "packages": mapping(boolean, SLURM_PACKAGES),
    "hw": mapping(number(0, MAX_HW), HW_KEYS),
    "hw_from": one_of("slurmd -C", "estimate"),
    "cgroup": one_of("v1", "v2"),
    "nvml": boolean,
    "gpu_files": listing(gpu_file, MAX_GPUS),
    "files": mapping(text, tuple(SLURM_FILES)),
    "mtimes": mapping(optional(number(0, MAX_HW)), tuple(SLURM_FILES)),
    "munge_key": optional(record({"exists": boolean, "owner": optional(word),
                                  "mode": optional(word), "sha256": optional(word)})),
    "services": mapping(record({"enabled": boolean, "active": boolean,
                                "since": optional(number(0, MAX_HW))}), SERVICES),
})
FIELDS: dict[str, Check] = {
    "user": word, "uid": number(0, 2**32), "home": word, "hostname": hostname,
    "python": word, "python_path": word,
    "sudo": record({"mode": one_of("root", "none", "nopasswd", "needs-password", "password",
                                   "wrong-password"), "why": optional(text)}),
    "gpu": GPU, "slurm": SLURM, "hosts": text, "env_file": text,
    "interface": optional(word), "interface_why": optional(text),
}
"""Each key's check; any other key of an asked section is ``loose``."""


def facts_reply(reply: dict[str, Any], only: list[str] | None) -> SetupFacts:
    """``reply`` checked, with the keys of every section ``only`` asked for (and the node's
    identity); anything else dropped. Raises :class:`BadReply`."""
    if not isinstance(reply, dict):
        raise _bad("the reply", reply, "a table")
    wanted = list(IDENTITY) + [k for name in sections(only) for k in SECTION_KEYS.get(name, ())]
    out: dict[str, Any] = {}
    for key in wanted:
        if key not in reply:
            if key in IDENTITY:
                raise _bad(key, None, "there (every reply names who and where the node is)")
            continue  # (a section may say nothing: workdir without one)
        FIELDS.get(key, loose)(key, reply[key])
        out[key] = reply[key]
    return cast(SetupFacts, out)


def output(where: str, value: Any) -> None:
    """A command's output (text, lines allowed; never None)."""
    if not isinstance(value, str):
        raise _bad(where, value, "a command's output")
    text(where, value)


DONE = record({"id": number(0, 2**31), "rc": number(-2**31, 2**31), "out": output})
"""A step's outcome (``node.setup_agent.StepDone``: the same keys)."""


def step_done(reply: Any) -> StepDone:
    """A ``done`` frame, checked. Raises :class:`BadReply`."""
    return cast(StepDone, checked(DONE, "the step's outcome", reply, ANSWER_REFUSED))


def fresh(reply: SetupFacts, only: list[str] | None) -> SetupFacts:
    """Of a checked reply, the sections ``only`` names: what a later ask may replace in facts
    the head holds, and sudo's state (read with every ask); never the identity checked at
    connect, never a key it did not ask for."""
    keys = {"sudo", *(k for name in sections(only) for k in SECTION_KEYS.get(name, ()))}
    return cast(SetupFacts, {k: v for k, v in reply.items() if k in keys})


# The sampler's samples (``node.sampler``), as ``monitor`` and ``ps`` receive them: every
# value the live table formats and every Prometheus label (``monitor --serve``) is checked
# here, so a node's bad sample is that node's error, never a failed scrape or a dead table.
LABEL = MOST_TEXT
"""Longest text of a sample (what becomes a label: names, ids, users)."""
MAX_SAMPLE_GPUS = 64
MAX_FIGURE = 2.0 ** 63


def label(where: str, value: Any) -> None:
    """Text fit for a label: one line, at most :data:`LABEL` characters."""
    if not isinstance(value, str) or len(value) > LABEL or CONTROL.search(value):
        raise _bad(where, value, f"one line of at most {LABEL} characters")


def note(where: str, value: Any) -> None:
    """Text the table shows (an error): at most 16 labels long."""
    if not isinstance(value, str) or len(value) > 16 * LABEL:
        raise _bad(where, value, f"text of at most {16 * LABEL} characters")


def figure(where: str, value: Any) -> None:
    """A finite number (int or float; a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not -MAX_FIGURE < value < MAX_FIGURE:  # (NaN and inf fail this too)
        raise _bad(where, value, "a finite number")


def table_of(values: Check, most: int) -> Check:
    """A dict of at most ``most`` label keys whose values pass ``values``."""
    def check(where: str, value: Any) -> None:
        if not isinstance(value, dict) or len(value) > most:
            raise _bad(where, value, f"a table of at most {most}")
        for k, v in value.items():
            label(f"{where} key", k)
            values(f"{where}.{k}", v)
    return check


def shown(where: str, value: Any) -> None:
    """Text of another user's lease record as the node read it: at most :data:`LABEL`
    characters (``records.well_formed`` believes no longer), any of them (a co-user may write an
    escape there; the console shows it as text, and Prometheus escapes a label)."""
    if not isinstance(value, str) or len(value) > LABEL:
        raise _bad(where, value, f"text of at most {LABEL} characters")


def lease(where: str, value: Any) -> None:
    """A lease record in a sample: the node's own rule (``records.sampled``), not a second
    one here."""
    if not sampled(value):
        raise _bad(where, value, "a lease record as a node keeps it")


def gpu_sample(where: str, value: Any) -> None:
    GPU_SAMPLE(where, value)
    if value.get("power_w") is not None:  # (the table shows "draw/limit W")
        figure(f"{where}.power_limit_w", value.get("power_limit_w"))


GPU_SAMPLE = record({
    "index": number(0, MAX_SAMPLE_GPUS - 1), "name": label, "uuid": optional(label),
    "util": figure, "mem_used": number(0, 2**62), "mem_total": number(0, 2**62),
    "power_w": optional(figure), "power_limit_w": optional(figure), "temp_c": optional(figure)})
POOL = record({
    "pid": number(1, 2**31), "rss": number(0, 2**62), "idle_since": optional(figure),
    "ranks": number(0, 2**31), "idle": optional(figure), "torch": label, "python": note,
    "started": optional(figure), "job": optional(label)})
"""One warm pool of the sampler's user (``node.warm.pools.listed``); ``job``: the job whose
restarts it is kept for (None: the user's own, ``run --warm``)."""
MAX_POOLS = 64
SAMPLE: dict[str, Check] = {
    "hostname": label, "time": figure, "cpu_percent": figure,
    "cpus": optional(number(1, 1 << 20)),
    "mem": record({"used": number(0, 2**62), "total": number(0, 2**62)}),
    "net": record({"rx_bps": figure, "tx_bps": figure}),
    "gpus": listing(gpu_sample, MAX_SAMPLE_GPUS), "gpu_error": optional(note),
    "leases": listing(lease, MAX_LEASES),
    "jobs": table_of(record({"user": optional(shown), "ranks": number(0, 2**31),
                             "gpus": listing(number(0, MAX_SAMPLE_GPUS - 1), MAX_SAMPLE_GPUS)}),
                     MAX_LEASES),
    "user": label,
    "pools": listing(POOL, MAX_POOLS),
}
"""Every key of a sample and its check (all are sent; a key not named here is dropped)."""


def sample_reply(sample: Any) -> Sample:
    """A sampler's ``sample`` checked, with the keys of :data:`SAMPLE` only. Raises
    :class:`BadReply`."""
    try:
        if not isinstance(sample, dict):
            raise _bad("the sample", sample, "a table")
        sample = {"pools": [], **sample}  # (a sampler that lists no pools: a fake node's)
        if isinstance(sample.get("leases"), list):  # (a bad record is dropped, not the sample)
            sample = {**sample, "leases": [r for r in sample["leases"] if sampled(r)]}
        for key, check in SAMPLE.items():
            if key not in sample:
                raise _bad(key, None, "there")
            check(key, sample[key])
    except BadReply as exc:
        raise exc.said_of(SAMPLE_REFUSED) from None
    return cast(Sample, {key: sample[key] for key in SAMPLE})
