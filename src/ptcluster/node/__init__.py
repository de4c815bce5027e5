"""The node side: every program that runs on a node or inside a rank, declared here, once.

Nothing of ptcluster is installed where these run, so every module in this package is shipped:
the head's packer (``remote.bootstrap``) puts a program's ``parts`` in front of its source and
drops the imports of them (marked ``# inlined``). What a shipped module may import follows from
its program's kind, and ``tests/local/test_shipped.py`` checks it for every module declared below:

* ``NODE`` programs (started by the head over a node channel): the standard library and their
  parts (plus an optional third-party module behind ``try``: ``OPTIONAL``);
* ``RANK`` programs (run inside a rank, under torchrun, or as torchrun's agent): the standard
  library, torch and their parts.

This ``__init__`` (and those of its subfolders) is not shipped: it is the head's list.
"""

from __future__ import annotations

from dataclasses import dataclass

NODE, RANK = "node", "rank"
OPTIONAL = ("psutil", "pynvml")
"""Third-party modules a node program may try to import (and must work without)."""


@dataclass(frozen=True)
class Program:
    """A shipped program: ``module`` is its main module; ``parts`` are the modules shipped in
    front of it, in order (each may import only those before it); ``hands`` are programs packed
    into this one for it to hand on (the guard gives its ranks their shim and stack probe, and
runs torchrun's agent program)."""

    name: str
    """Its label where it runs: ``ptcluster-NAME`` in tracebacks, ``ps`` and stacks."""
    module: str
    kind: str = NODE
    parts: tuple[str, ...] = ()
    hands: tuple[Program, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        return (*self.parts, self.module)


_N = "ptcluster.node."
WIRE, NETIF, RANK_WIRE = _N + "wire", _N + "netif", _N + "rank_wire"

SHIM = Program("shim", _N + "rank.shim", RANK, (RANK_WIRE,))
"""Every rank's process: the parent around the user's program (reads no torch itself)."""
STACK_PROBE = Program("stack-probe", _N + "rank.stack_probe", RANK, (RANK_WIRE,))
"""Installed by the shim in the rank's process: stacks on request, collectives' progress."""
TORCHRUN_AGENT = Program("torchrun", _N + "rank.torchrun_agent", RANK)
"""torchrun on every node, run by the guard: the rendezvous store outlives the exit barrier."""
_G = _N + "guard."
KERNEL_LOG = _N + "kernel_log"
RDMA = _N + "rdma"
"""The RDMA devices in sysfs and the NCCL settings they call for: doctor's facts, the guard's."""
HEALTH = (_N + "gpu_errors", _N + "health")
"""The health gate's parts (after ``accel`` and ``KERNEL_LOG``): the guard's, doctor's, probe's."""
GUARD = Program("guard", _G + "agent", NODE,
                (WIRE, NETIF, RANK_WIRE, _N + "safefile", _G + "proctree", _G + "progress",
                 _G + "outbox", _G + "schedstat", KERNEL_LOG, _N + "gpu_errors", _G + "disk",
                 _G + "machine", _G + "rank_server",
                 _G + "link", _G + "teardown", _N + "records", _N + "leases", _G + "refusal",
                 _G + "tmpdirs", _N + "accel", _G + "gpus", _N + "health", RDMA,
                 _N + "nccl_log", _G + "prechecks",
                 _G + "spawn"),
                hands=(SHIM, STACK_PROBE, TORCHRUN_AGENT))
"""Run's node agent: owns one node's part of a job."""
FACTS = Program("facts", _N + "doctor_facts", NODE,
                (WIRE, NETIF, _N + "accel", _N + "firewall", KERNEL_LOG, *HEALTH, RDMA))
"""The doctor's node program: the node's facts, then its port and peer tests."""
SAFE_LEASES = (_N + "safefile", _N + "records", _N + "leases")
"""The parts of every program that reads or takes leases."""
SAMPLER = Program("sampler", _N + "sampler", NODE, (WIRE, *SAFE_LEASES))
"""The monitor's node program: one sample per interval."""
SETUP_AGENT = Program("setup", _N + "setup_agent", NODE,
                      (WIRE, NETIF, _N + "accel", _N + "firewall", _N + "slurm_facts",
                       _N + "setup_facts"))
"""Setup's node program: facts, then the commands the head asks for."""
KILL = Program("kill", _N + "kill", NODE, (WIRE, *SAFE_LEASES))
"""``ptcluster kill``'s node program: signals one job's guard (found by its lease)."""
PROBE = Program("probe", _N + "probe", NODE, (WIRE, _N + "accel", KERNEL_LOG, *HEALTH))
"""Asks a lost node once more: its boot, whether the job's guard still runs."""
ALLREDUCE = Program("allreduce", _N + "rank.allreduce", RANK, (RANK_WIRE, _N + "rank.api"))
"""The doctor's last check, in every rank: a verified all-reduce."""
BENCH_WORKER = Program("bench", _N + "rank.bench_worker", RANK, (RANK_WIRE, _N + "rank.api"))
"""``ptcluster bench``'s sweep, in every rank."""

BLOBS = _N + "blobs"
"""Files received raw on the channel by digest, temp name then rename: every program that
receives files from the head."""
VENVS = Program("venvs", _N + "venv_agent", NODE,
                (WIRE, _N + "safefile", _N + "records", BLOBS, _N + "venv_store"))
"""The project's environment on a node: have, receive, build, check, list, prune."""
PUSH = Program("push", _N + "data_agent", NODE, (WIRE, BLOBS, _N + "data_relay"))
"""``ptcluster push``'s node program: which files differ, the missing ones received, digests."""
CKPT_LIST = Program("ckpt-list", _N + "ckpt_list", NODE, (WIRE,))
"""``ptcluster collect``'s node program: what the node holds of a checkpoint directory."""

PROGRAMS = (GUARD, SHIM, STACK_PROBE, TORCHRUN_AGENT, FACTS, SAMPLER, SETUP_AGENT, KILL, PROBE,
            ALLREDUCE, BENCH_WORKER, VENVS, PUSH, CKPT_LIST)
