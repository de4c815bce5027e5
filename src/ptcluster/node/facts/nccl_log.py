"""What NCCL chose, read from its own debug log: the transport (InfiniBand/RoCE through
``NET/IB``, or TCP ``NET/Socket``), the HCAs and the GID index.

Standard library only; a part of the guard (``node/__init__.py``). The guard has NCCL write
``NCCL_DEBUG=INFO`` lines of the ``INIT,NET,ENV`` subsystems to a file per rank in its job's
private directory (``NCCL_DEBUG_FILE``, so the console stays as it was) and reads them when the
ranks are done. NCCL's log is text for people, not an interface (no version promises its
wording), so this reads only the lines NCCL has printed the same way since 2.4 and says
``None`` for what it does not find::

    NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE [RO]; OOB eth0:10.0.0.1<0>
    NET/IB : No device found.
    NET/Socket : Using [0]eth0:10.0.0.1<0>
    Using network IB            (IB, IBext, IBext_v8: RDMA; Socket: TCP; else a plugin's name)
    NCCL_IB_GID_INDEX set by environment to 3.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Literal, TypedDict

from ptcluster.node.wire import NcclChoice

DEBUG_FILE = "nccl.%h.%p.log"
"""``NCCL_DEBUG_FILE``'s name in the guard's job directory: NCCL puts the host and pid in."""
DEBUG_PREFIX = "nccl."
DEBUG_SUBSYS = "INIT,NET,ENV"
"""INIT and NET say what NCCL chose; ENV the variables it took (the GID index among them)."""
IB, SOCKET = "IB", "Socket"
MAX_BYTES = 1 << 20
MAX_FILES = 64

_IB_USING = re.compile(r"NET/IB ?: Using (.*?)(?:;|$)")
_IB_DEV = re.compile(r"\[\d+\]([\w.-]+:\d+)/(IB|RoCE)")
_SOCKET_USING = re.compile(r"NET/Socket ?: Using (.*)$")
_SOCKET_DEV = re.compile(r"\[\d+\]([\w.@-]+):")
_NETWORK = re.compile(r"Using network (\S+)")
_GID = re.compile(r"NCCL_IB_GID_INDEX set by environment to (-?\d+)")


class RankChoice(TypedDict):
    """One rank's choice, from its debug file (:func:`parse`)."""

    transport: str | None
    """``IB``, ``Socket``, a plugin's network, or None."""
    network: str | None
    """As NCCL named it."""
    hca: str | None
    """``mlx5_0:1,mlx5_1:1``."""
    link: str | None
    """``IB``, ``RoCE``."""
    sockets: str | None
    """The interfaces NET/Socket uses."""
    gid_index: int | None
    no_ib_device: bool


def parse(lines: Iterable[str]) -> RankChoice:
    """One rank's choice (:class:`RankChoice`)."""
    found: RankChoice = {"transport": None, "network": None, "hca": None, "link": None,
                         "sockets": None, "gid_index": None, "no_ib_device": False}
    for line in lines:
        if "NCCL" not in line:
            continue
        if (m := _IB_USING.search(line)) is not None:
            devs = _IB_DEV.findall(m[1])
            if devs:
                found["hca"] = ",".join(d for d, _ in devs)
                found["link"] = "+".join(sorted({kind for _, kind in devs}))
        elif "NET/IB" in line and "No device found" in line:
            found["no_ib_device"] = True
        elif (m := _SOCKET_USING.search(line)) is not None:
            found["sockets"] = ",".join(_SOCKET_DEV.findall(m[1])) or None
        elif (m := _NETWORK.search(line)) is not None:
            found["network"] = m[1]
        elif (m := _GID.search(line)) is not None:
            found["gid_index"] = int(m[1])
    net = found["network"]
    if net is not None:  # NCCL >= 2.5 names it; IBext* is the IB plugin (HPC-X, SHARP)
        found["transport"] = IB if net.startswith(IB) else net
    elif found["hca"]:  # older NCCL: NET/IB found a device, so IB it was
        found["transport"] = IB
    elif found["sockets"] or found["no_ib_device"]:
        found["transport"] = SOCKET
    if found["transport"] != IB:
        found["hca"] = found["link"] = None  # listed, not used
    return found


def merge(ranks: list[RankChoice]) -> NcclChoice | None:
    """One node's answer from its ranks' (they normally agree; where not, every value seen,
    joined by ``+``); None when no rank said anything."""
    said = [r for r in ranks if r["transport"]]
    if not said:
        return None

    def seen(key: Literal["transport", "hca", "link", "sockets", "gid_index"]) -> list[str]:
        return sorted({str(r[key]) for r in said if r[key] is not None})

    def joined(key: Literal["transport", "hca", "link", "sockets"]) -> str | None:
        return "+".join(seen(key)) or None

    gids = seen("gid_index")
    return {"transport": joined("transport"), "hca": joined("hca"), "link": joined("link"),
            "sockets": joined("sockets"),
            "gid_index": None if not gids else int(gids[0]) if len(gids) == 1 else "+".join(gids),
            "ranks": len(said)}


def read_dir(path: str) -> NcclChoice | None:
    """The node's answer from the debug files NCCL wrote in ``path`` (the guard's job dir)."""
    try:
        names = sorted(n for n in os.listdir(path) if n.startswith(DEBUG_PREFIX))[:MAX_FILES]
    except OSError:
        return None
    ranks = []
    for name in names:
        try:
            with open(os.path.join(path, name), "rb") as f:
                text = f.read(MAX_BYTES).decode("utf-8", "replace")
        except OSError:
            continue
        ranks.append(parse(text.splitlines()))
    return merge(ranks)
