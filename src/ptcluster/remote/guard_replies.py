"""The schemas of the tables inside a guard's frames (``node.wire``'s ``ReadyFacts``,
``OomFacts``, ``XidFacts``, ``DiskFacts`` and the ``timing`` figures), checked where the head
decodes a frame (``launch.supervise.events.decode``), beside :mod:`ptcluster.remote.replies`
and built from its checks.

What the head acts on is checked by structure: a ready frame's ``address`` (an IP literal or a
DNS name: it becomes the next attempt's ``MASTER_ADDR`` after a restart), its ``master_port``,
interface, pids, the GPUs it chose; numbers are bounded and finite. What the head only shows or
records (a driver's words, a reason, a process name) is bounded text. A table with a key the guard
does not send is refused, never merged: the guard is shipped by this head, so a frame it does not
know is a node that runs something else. A frame that fails decodes as ``Malformed``: that
node's failure, named (``events.malformed``), never an exception in a reader.
"""

from __future__ import annotations

import ipaddress
from typing import Any, cast

from ptcluster.cluster.validate import is_dns_name
from ptcluster.node import wire
from ptcluster.node.facts.gpu_errors import ACT_HARDWARE, ACT_JOB, ACT_REBOOT, ACT_RESET, ACT_WATCH
from ptcluster.remote.diagnoses import ANSWER_REFUSED
from ptcluster.remote.node_replies import note
from ptcluster.remote.replies import (
    LABEL,
    MAX_GPUS,
    BadReply,
    Check,
    _bad,
    boolean,
    figure,
    hostname,
    listing,
    number,
    one_of,
    optional,
    record,
    table_of,
    word,
)

BYTES = number(0, 2**62)
PID = number(1, 2**31)
COUNT = number(-2**62, 2**62)
"""A counter's rise (the kernel's OOM counts: a group made again starts from 0)."""
MOST_RANK = 1 << 24
MOST_VICTIMS = 4096
MOST_XIDS = 4096
IFNAMSIZ = 16
"""Linux's limit on an interface's name, its NUL included."""


def address(where: str, value: Any) -> None:
    """Where peers reach a node: an IP literal or a DNS name (one line, nothing else)."""
    if isinstance(value, str):
        try:
            ipaddress.ip_address(value)
            return
        except ValueError:
            if is_dns_name(value):
                return
    raise _bad(where, value, "an IP address or a DNS name")


def interface(where: str, value: Any) -> None:
    """A network interface's name, as Linux allows it (at most 15 bytes, no '/', no space)."""
    if not isinstance(value, str) or not 0 < len(value.encode()) < IFNAMSIZ \
            or "/" in value or any(c.isspace() or not c.isprintable() for c in value):
        raise _bad(where, value, "an interface's name")


def version(where: str, value: Any) -> None:
    """A package's version (``2.13.0+cpu``): one short line."""
    if not isinstance(value, str) or len(value) > LABEL:
        raise _bad(where, value, f"a version of at most {LABEL} characters")
    word(where, value)


def digits(where: str, value: Any) -> None:
    """A small whole number written as text (an environment variable's value: ``3``)."""
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() \
            or len(value) > 6:
        raise _bad(where, value, "a whole number as text")


GPUS = record({"indices": optional(listing(number(0, MAX_GPUS), MAX_GPUS)),
               "visible": word, "why": note, "by": optional(one_of("preset", "listed", "auto")),
               "skipped": optional(table_of(note, MAX_GPUS)), "nvml": optional(boolean),
               "leased": optional(boolean)})
"""``guard.gpus.claim``'s report: the GPUs the job holds on the node."""
READY = record({
    "hostname": hostname, "pid": PID, "python": word, "time": figure, "workdir": word,
    "boot_id": optional(word), "uptime": optional(figure),
    "subreaper": optional(boolean), "subreaper_error": optional(note),
    "leases_off": optional(note), "master_port": optional(number(1, 65535)),
    "gpus": optional(GPUS), "interface": optional(interface),
    "interface_source": optional(note), "address": optional(address),
    "rdma": optional(record({"NCCL_IB_HCA": optional(word), "NCCL_IB_GID_INDEX":
                             optional(digits)})),
    "torch": optional(version), "nccl": optional(version), "pool": optional(boolean),
})
"""A guard's ``ready`` facts (``guard.prechecks.precheck``); ``torchrun_pid`` is the head's
own (from the ``started`` frame), never the node's."""
VICTIM = record({"pid": PID, "comm": note, "rss": optional(BYTES), "constraint": optional(word),
                 "memcg": optional(word), "main": optional(boolean),
                 "tied": optional(one_of("tree", "group"))})
OOM = record({
    "node_kills": COUNT, "group_kills": optional(COUNT), "group": optional(word),
    "group_limit": optional(BYTES), "log": word, "victims": listing(VICTIM, MOST_VICTIMS),
    "oomd": optional(record({"group": word, "why": note})),
    "mem_available": optional(BYTES), "mem_total": optional(BYTES),
})
"""A failed rank's ``oom`` (``guard.machine.MachineWatch.after_exit``)."""
XID = record({
    "pci": word, "gpu": optional(number(0, MAX_GPUS)), "xid": number(0, 1 << 20),
    "pid": number(0, 2**31), "name": note, "rank": optional(number(0, MOST_RANK)),
    "text": note, "meaning": note,
    "action": one_of(ACT_JOB, ACT_WATCH, ACT_RESET, ACT_REBOOT, ACT_HARDWARE),
    "fix": note, "fatal": boolean, "at": figure, "clock": optional(word),
    "jobs_gpu": optional(boolean),
})
"""One Xid (``guard.machine.MachineWatch.note_xid``): a ``xid`` frame, a rank exit's ``xids``."""
FILESYSTEM: dict[str, Check] = {"path": optional(word), "mount": word,
                                "fstype": optional(word), "source": optional(word),
                                "free": BYTES, "total": BYTES}


def disk(where: str, value: Any) -> None:
    """A rank's full disk (``guard.disk.disk_facts``): its file's filesystem, or the nearly
    full ones."""
    if isinstance(value, dict) and set(value) == {"full"}:
        listing(record(FILESYSTEM), 64)(f"{where}.full", value["full"])
    else:
        record(FILESYSTEM)(where, value)


RANK_FIGURES = record({"span": figure, "run": figure, "delay": figure,
                       "collectives": optional(COUNT)})
FIGURES = table_of(RANK_FIGURES, 1 << 16)
NODE_FIGURES = record({"mem_available": optional(figure), "gpu_util": optional(figure),
                       "cpu_throttled": optional(figure)})
"""A ``timing`` frame's ``ranks`` (``guard.schedstat``) and ``node``."""


def _checked(check: Check, what: str, value: Any) -> Any:
    try:
        check(what, value)
    except BadReply as exc:  # (a ValueError: the frame decodes as Malformed, the node named)
        raise exc.said_of(ANSWER_REFUSED) from None
    return value


def ready_facts(body: Any) -> wire.ReadyFacts:
    """A ``ready`` frame's facts, checked. Raises :class:`BadReply`."""
    return cast(wire.ReadyFacts, dict(_checked(READY, "ready", body)))


def oom_facts(body: Any) -> wire.OomFacts:
    return cast(wire.OomFacts, _checked(OOM, "oom", body))


def xid_facts(body: Any) -> wire.XidFacts:
    return cast(wire.XidFacts, _checked(XID, "xid", body))


def xids(body: Any) -> tuple[wire.XidFacts, ...]:
    return tuple(cast(list[wire.XidFacts], _checked(listing(XID, MOST_XIDS), "xids", body)))


def disk_facts(body: Any) -> wire.DiskFacts:
    return cast(wire.DiskFacts, _checked(disk, "disk", body))


def timing(ranks: Any, node: Any) -> tuple[dict[str, wire.RankTiming], wire.NodeTiming]:
    """A ``timing`` frame's per-rank figures and the node's, checked."""
    return _checked(FIGURES, "timing.ranks", ranks), _checked(NODE_FIGURES, "timing.node", node)
