"""The schemas of the doctor's, kill's, the probe's and the checkpoint listing's replies
(``node.doctor_facts``, ``node.kill``, ``node.probe``, ``node.ckpt_list``), checked as they
arrive (``doctor.collect``, ``control.kill``, ``launch.lost``, ``checkpoint.collect``), beside
:mod:`ptcluster.remote.replies` and built from its checks.

Doctor: what the head reads by structure (the node's hostname, its clock, ports it listens on, its
interfaces and addresses, routes, the workdir and disk) is checked field by field; the rest of
the reply (GPUs, torch, firewall, RDMA, health) is JSON whose every string is one bounded line
of text or a bounded note, and whose lists and tables are bounded. A reply that fails is that
node's failed ``reach`` check, named; the node's facts are never kept.
"""

from __future__ import annotations

from typing import Any, cast

from ptcluster.node.ckpt_list import CkptAnswer
from ptcluster.node.doctor_facts import Connect, DoctorFacts
from ptcluster.node.kill import KillAnswer
from ptcluster.node.probe import BootAnswer
from ptcluster.node.wire import WarmAnswer
from ptcluster.remote.diagnoses import ANSWER_REFUSED, DOCTOR_FACTS_REFUSED
from ptcluster.remote.replies import (
    LABEL,
    MAX_POOLS,
    MAX_WORD,
    POOL,
    BadReply,
    Check,
    _bad,
    boolean,
    checked,
    figure,
    hostname,
    listing,
    mapping,
    number,
    optional,
    record,
    text,
    word,
)

MOST_ITEMS = 4096
"""Longest list, most keys of a table in a doctor's reply."""
MOST_NOTE = 16 * MAX_WORD
"""Longest text in a doctor's reply (a tool's error output)."""
PORT = number(0, 65535)


def note(where: str, value: Any) -> None:
    if not isinstance(value, str) or len(value) > MOST_NOTE:
        raise _bad(where, value, f"text of at most {MOST_NOTE} characters")


def bounded(where: str, value: Any, depth: int = 0) -> None:
    """Any JSON of at most 12 levels, its lists and tables at most :data:`MOST_ITEMS` long,
    its strings notes."""
    if depth > 12:
        raise _bad(where, value, "JSON of at most 12 levels")
    if isinstance(value, str):
        note(where, value)
    elif isinstance(value, (dict, list)):
        if len(value) > MOST_ITEMS:
            raise _bad(where, value, f"at most {MOST_ITEMS} items")
        for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(k, str):
                word(f"{where} key", k)
            bounded(f"{where}.{k}", v, depth + 1)
    elif isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
        figure(where, value)
    elif value is not None and not isinstance(value, bool):
        raise _bad(where, value, "JSON")


ADDRS = listing(word, 64)
ROUTE = record({"addrs": ADDRS, "route_dev": optional(word)})
MASTER = record({"addrs": ADDRS, "route_dev": optional(word), "interface": optional(word),
                 "interface_error": optional(note)})
PYTHON = record({"executable": word, "version": word})
WORKDIR = record({"path": word, "exists": boolean, "writable": boolean})
SPACE = record({"free": number(0, 2**62), "total": number(0, 2**62)})
LISTENING = record({"master": optional(PORT), "ephemeral": optional(PORT),
                    "master_error": optional(note), "ephemeral_error": optional(note)})
SECTIONS = {"python": PYTHON, "workdir": WORKDIR, "peers": ROUTE, "master": MASTER,
            "shm": SPACE, "disk": SPACE, "listening": LISTENING}
"""The doctor's sections checked field by field (``node.doctor_facts``: each the keys of its
TypedDict there, ``tests/unit/test_readmit.py`` compares them)."""
FIELDS: dict[str, Check] = {
    "time": figure, "hostname": hostname, "hostname_addrs": ADDRS,
    "python": PYTHON, "workdir": WORKDIR, "peers": mapping(ROUTE), "master": optional(MASTER),
    "interfaces": listing(record({"name": word, "up": optional(boolean), "ipv4": ADDRS}),
                          MOST_ITEMS),
    "interfaces_error": optional(note),
    "ephemeral_range": optional(listing(PORT, 2)),
    "shm": optional(SPACE), "disk": optional(SPACE), "listening": LISTENING,
}
"""The keys the doctor reads by structure, each with its check; the others are
:func:`bounded` (every one a key of ``node.doctor_facts.DoctorFacts``)."""
REQUIRED = ("time", "hostname", "workdir", "interfaces", "listening")


def doctor_reply(reply: Any) -> DoctorFacts:
    """The doctor's facts ``reply`` checked (``node.doctor_facts.DoctorFacts``). Raises
    :class:`BadReply`."""
    try:
        if not isinstance(reply, dict) or len(reply) > 64:
            raise _bad("the reply", reply, "a table of at most 64 keys")
        for key in REQUIRED:
            if key not in reply:
                raise _bad(key, None, "there")
        for key, value in reply.items():
            word("a key", key)
            FIELDS.get(key, bounded)(key, value)
    except BadReply as exc:
        raise exc.said_of(DOCTOR_FACTS_REFUSED) from None
    return cast(DoctorFacts, reply)


CONNECT = record({"label": word, "host": word, "port": PORT, "error": optional(note),
                  "ms": figure})
"""One connection a node tried (``node.doctor_facts.Connect``: the ``connect`` frame's
``results``)."""


def connect_results(answer: Any) -> list[Connect]:
    """A node's ``connect`` frame's results, checked. Raises :class:`BadReply`."""
    checked = _answer(record({"results": listing(CONNECT, MOST_ITEMS)}), "the connect answer",
                      answer)
    return cast(list[Connect], checked["results"])


def _answer(schema: Check, what: str, answer: Any) -> dict[str, Any]:
    return dict(checked(schema, what, answer, ANSWER_REFUSED))


def _label(where: str, value: Any) -> None:
    if not isinstance(value, str) or len(value) > LABEL:
        raise _bad(where, value, f"text of at most {LABEL} characters")


SENT = record({"what": note, "fix": note, "code": optional(word), "fields": optional(bounded)})
"""A declared problem as a node's program sends it (``node.problems.Sent``)."""
KILL = record({"found": boolean, "pid": optional(number(1, 2**31)), "user": optional(_label),
               "note_error": optional(note), "signalled": optional(boolean),
               "error": optional(note), "problem": optional(SENT)})
"""``node.kill``'s ``result`` (``end_job``)."""
BOOT = record({"boot_id": optional(word), "uptime": optional(figure), "time": figure,
               "guard_alive": optional(boolean), "kernel": optional(listing(note, 64)),
               "unfit": optional(SENT)})
"""``node.probe``'s ``boot`` (``answer``; ``unfit``: its health gate's refusal, when asked)."""


WARM = record({"pools": listing(POOL, MAX_POOLS), "stopped": listing(record({
    "pid": number(1, 2**31), "gone": boolean, "ranks": number(0, 2**31)}), MAX_POOLS)})
"""``node.warm.pools``' ``result`` (``warm stop``: what became of each pool)."""


def held_file(where: str, value: Any) -> None:
    """``[path relative to the root, size]`` of a file a node holds."""
    if not isinstance(value, list) or len(value) != 2:
        raise _bad(where, value, "[path, size]")
    word(f"{where}[0]", value[0])
    number(0, 2**62)(f"{where}[1]", value[1])


MOST_STEPS = 1 << 16
HELD = record({"step": number(0, 2**62), "marker": optional(text),
               "files": mapping(held_file)})
CKPT = record({"root": word, "steps": optional(listing(HELD, MOST_STEPS)),
               "missing": optional(note)})
"""``node.ckpt_list``'s ``ckpt`` frame (``main``), each step its ``StepHeld``."""


def ckpt_answer(answer: Any) -> CkptAnswer:
    """A node's ``ckpt`` frame checked. Raises :class:`BadReply`."""
    return cast(CkptAnswer, _answer(CKPT, "the checkpoint listing", answer))


def warm_answer(answer: Any) -> WarmAnswer:
    """A node's ``warm`` result checked. Raises :class:`BadReply`."""
    return cast(WarmAnswer, _answer(WARM, "warm's answer", answer))


def kill_answer(answer: Any) -> KillAnswer:
    """A node's kill ``result`` checked. Raises :class:`BadReply`."""
    return cast(KillAnswer, _answer(KILL, "kill's answer", answer))


def boot_answer(answer: Any) -> BootAnswer:
    """A node's probe ``boot`` answer checked. Raises :class:`BadReply`."""
    return cast(BootAnswer, _answer(BOOT, "the probe's answer", answer))
