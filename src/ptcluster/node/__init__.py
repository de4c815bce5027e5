"""The node side: every program that runs on a node or inside a rank, declared here, once.

Nothing of ptcluster is installed where these run, so every module in this package is shipped:
the head's packer (``remote.bootstrap``) sends a program as its modules, the program's module
and every ``ptcluster`` module it imports (its import closure, computed), which ``importer``
(the hook every shipped program starts with) makes importable on the node. What a shipped module
may import follows from its program's kind, and ``tests/local/test_shipped.py`` checks it for
every module shipped with a program declared below:

* ``NODE`` programs (started by the head over a node channel): the standard library and the
  node package (plus an optional third-party module behind ``try``: ``OPTIONAL``);
* ``RANK`` programs (run inside a rank, under torchrun, or as torchrun's agent): the standard
  library, torch and the node package. They have a ``main()``: the import hook is taken away
  before it runs (a user's code must import an installed ``ptcluster``, never ours).

This ``__init__`` (and those of its subfolders) is not shipped: it is the head's list.
"""

from __future__ import annotations

from dataclasses import dataclass

NODE, RANK = "node", "rank"
OPTIONAL = ("psutil", "pynvml")
"""Third-party modules a node program may try to import (and must work without)."""


@dataclass(frozen=True)
class Program:
    """A shipped program: ``module`` is its main module (what it imports is shipped with it:
    ``remote.bootstrap.shipped``); ``hands`` are programs packed into this one for it to hand on
    (the guard gives its ranks their shim, and runs torchrun's agent program)."""

    name: str
    """Its label where it runs: ``ptcluster-NAME`` in ``ps`` and on the first-stage's frames."""
    module: str
    kind: str = NODE
    parts: tuple[str, ...] = ()
    """Modules shipped besides the ones its module imports (none need be named: the import
    closure is computed; a declaration that lists its imports here stays valid)."""
    hands: tuple[Program, ...] = ()


_N = "ptcluster.node."
IMPORTER = _N + "importer"
"""The import hook: the source in front of every packed program (not a program)."""
SHIM = Program("shim", _N + "rank.shim", RANK)
"""Every rank's process: the parent around the user's program (reads no torch itself), and the
stack probe it installs in the rank's process (stacks on request, collectives' progress)."""
TORCHRUN_AGENT = Program("torchrun", _N + "rank.torchrun_agent", RANK)
"""torchrun on every node, run by the guard: the rendezvous store outlives the exit barrier."""
WARM_POOL = Program("warm-pool", _N + "warm.pool", RANK)
"""``run --warm``: this user's pool of interpreters with torch imported, started by a guard."""
WARM = Program("warm", _N + "warm.pools")
"""This user's warm pools on a node: listed, or ended (``ptcluster warm stop``)."""
GUARD = Program("guard", _N + "guard.agent", hands=(SHIM, TORCHRUN_AGENT, WARM_POOL))
"""Run's node agent: owns one node's part of a job."""
FACTS = Program("facts", _N + "doctor_facts")
"""The doctor's node program: the node's facts, then its port and peer tests."""
SAMPLER = Program("sampler", _N + "sampler")
"""The monitor's node program: one sample per interval."""
SETUP_AGENT = Program("setup", _N + "setup_agent")
"""Setup's node program: facts, then the commands the head asks for."""
KILL = Program("kill", _N + "kill")
"""``ptcluster kill``'s node program: signals one job's guard (found by its lease)."""
PROBE = Program("probe", _N + "probe")
"""Asks a lost node once more: its boot, whether the job's guard still runs."""
ALLREDUCE = Program("allreduce", _N + "rank.allreduce", RANK)
"""The doctor's last check, in every rank: a verified all-reduce."""
BENCH_WORKER = Program("bench", _N + "rank.bench_worker", RANK)
"""``ptcluster bench``'s sweep, in every rank."""

VENVS = Program("venvs", _N + "venv_agent")
"""The project's environment on a node: have, receive, build, check, list, prune."""
PUSH = Program("push", _N + "data_agent")
"""``ptcluster push``'s node program: which files differ, the missing ones received, digests."""
CKPT_LIST = Program("ckpt-list", _N + "ckpt_list")
"""``ptcluster collect``'s node program: what the node holds of a checkpoint directory."""

PROGRAMS = (GUARD, SHIM, TORCHRUN_AGENT, WARM_POOL, FACTS, SAMPLER, SETUP_AGENT, KILL, PROBE,
            ALLREDUCE, BENCH_WORKER, VENVS, PUSH, CKPT_LIST, WARM)
