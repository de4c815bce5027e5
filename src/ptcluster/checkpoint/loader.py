"""``load``: the newest checkpoint complete somewhere in the job, read from wherever its files
are (a node's own part, a replica on its peer), into ``state`` in place, in any world size.

Every rank's node lists what its disk holds (the leaders do; ``layout.list_node``); a gather
gives every rank the same listings, so every rank chooses the same step (``layout.choose``).
Each node then gets the files its ranks need into a private load folder: a hard link of a file
it holds itself, else the bytes from a node that holds it, sent by that node's leader through
the checkpoint's gloo group (``transfer.py``). DCP's own ``FileSystemReader`` reads that folder:
DCP plans which items each rank reads and reshards them to the current world.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from ptcluster.checkpoint import layout
from ptcluster.checkpoint.place import Place, place
from ptcluster.checkpoint.saver import wait
from ptcluster.checkpoint.transfer import Incoming, Outgoing, exchange

log = logging.getLogger(__name__)

DCP_METADATA = ".metadata"
"""The name DCP's ``FileSystemWriter`` gives the checkpoint's metadata (on rank 0's node)."""


def load(state: dict[str, Any], dir: str = "ckpt", step: int | None = None) -> int | None:
    """Restore ``state`` in place from the newest complete checkpoint (or ``step``) under
    ``dir`` on the job's nodes; its step, or None when there is none (logged, never raised)."""
    wait()
    where = place()
    root = layout.root_dir(dir)
    layout.check_owner(root)
    mine = layout.list_node(root) if where.leader else None
    every = where.gather(mine)
    listings = [every[leader] for leader in where.leaders]
    choice, why = layout.choose(listings, step)
    if choice is None and where.leader:
        log.warning("no checkpoint to resume from under %s: %s; starting fresh", root, why)
    if choice is None:
        _report(where, 0)
        return None
    found = choice.manifest.step
    folder = root / f".load-{found}"
    if where.leader:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    try:
        _gather_files(where, root, folder, choice, listings, {DCP_METADATA})
        reader = dcp.FileSystemReader(folder)
        _gather_files(where, root, folder, choice, listings,
                      _needed(state, reader.read_metadata()))
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), process_group=where.group)
    finally:
        where.barrier()
        if where.leader:
            shutil.rmtree(folder, ignore_errors=True)
    log.info("resumed from step %d under %s", found, root)
    _report(where, found)
    return found


def _report(where: Place, step: int) -> None:
    """Tell ptcluster's head where this attempt starts (``resumed_from``, a no-op outside
    ``ptcluster run``): with ``checkpoint_saved`` it makes ``--max-restarts``' no-progress rule
    apply. Once per node, as the saves report."""
    if where.leader:
        from ptcluster.node.rank.api import resumed_from

        resumed_from(step)


def _needed(state: dict[str, Any], metadata: Any) -> set[str]:
    """The files DCP will read for this rank's part of ``state`` (its own planner's plan)."""
    plain = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(plain, metadata, is_coordinator=False)
    plan = planner.create_local_plan()
    return {metadata.storage_data[item.storage_index].relative_path for item in plan.items}


def _gather_files(where: Place, root: Path, folder: Path, choice: layout.Choice,
                  listings: list[list[layout.Holding]], needs: set[str]) -> None:
    """Every file some rank of a node needs, into that node's load ``folder``."""
    files = choice.manifest.files()
    wanted: dict[int, set[str]] = {}
    for rank, names in enumerate(where.gather(sorted(needs))):
        wanted.setdefault(where.node_of[rank], set()).update(names)
    transfers, failed = [], None
    for node in sorted(wanted):
        for name in sorted(wanted[node]):
            holders = choice.holders[name]
            if node not in holders:
                transfers.append((name, holders[0], node))
            elif node == where.node and where.leader:
                try:
                    _link(root / _path(listings[node], choice, name), folder / name,
                          files[name])
                except OSError as exc:  # said after the transfers: no peer left blocked
                    failed = f"{exc}"
    for name, src, dst in transfers:
        size, sha = files[name]
        if where.leaders[src] == where.rank:
            failed = exchange(where.group, where.leaders[dst],
                              [Outgoing(root / _path(listings[src], choice, name), size)],
                              None, []) or failed
        elif where.leaders[dst] == where.rank:
            failed = exchange(where.group, None, [], where.leaders[src],
                              [Incoming(folder / name, size, sha)]) or failed
    said = [f"node {where.node_of[r]}: {e}" for r, e in enumerate(where.gather(failed)) if e]
    if said:
        raise OSError(f"step {choice.manifest.step}: fetching its files failed "
                      f"({'; '.join(said)})")


def _path(listing: list[layout.Holding], choice: layout.Choice, name: str) -> str:
    held = next(h for h in listing if h.step == choice.manifest.step)
    return str(held.files[name][0])


def _link(src: Path, dst: Path, info: list) -> None:
    """``src`` (this node's own copy) into the load folder, checked against its sha256."""
    if dst.exists():
        return
    if layout.sha256_of(src) != info[1]:
        raise OSError(f"{src}: its bytes do not match the checkpoint's marker (changed "
                      f"after the save?)")
    try:
        os.link(src, dst)
    except OSError:  # another filesystem under the root: a copy
        shutil.copyfile(src, dst)
