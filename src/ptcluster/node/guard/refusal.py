"""The guard's refusal (``GuardError``, sent to the head as ``error {problem, fix, busy,
unhealthy, environment}``: the head's ``GuardRefused``), raised by its prechecks and its choice
of GPUs.

Its ``problem`` and ``fix`` are plain strings, not ``ptcluster.errors.Problem``: this module is
shipped (it cannot import the head's package), and the frame is JSON anyway. The head makes the
one ``Problem`` of them where it decodes the frame (``launch.supervise.events``).

Standard library only; a part of the guard (shipped by ``remote.bootstrap``).
"""

from __future__ import annotations

from ptcluster.node.sharing.leases import LEASE_DIR


class GuardError(Exception):
    """The guard refuses: what is wrong on this node, and the fix."""

    def __init__(self, problem: str, fix: str, busy: bool = False,
                 unhealthy: bool = False, environment: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix
        self.busy = busy
        """Refused only because another job holds what this one asks for (it may wait)."""
        self.unhealthy = unhealthy
        """Refused by the health gate (``node.facts.health``): a restart leaves the node out."""
        self.environment = environment
        """``missing`` or ``changed``: the project's environment the head expected is not
        ready here (``prechecks.project_environment``): the head ships and builds it, then
        launches again."""


UNLEASED_FIX = (f"have root make {LEASE_DIR} what Debian and Ubuntu make it at every boot, a "
                f"directory of root's with mode 1777 (`install -d -m 1777 -o root -g root "
                f"{LEASE_DIR}`), or pass `run --no-leases` to run without leases (unsafe: other "
                "jobs may take this job's GPUs and port, and `ps` and `kill` do not see it "
                "there)")
"""What to do about a lease directory that cannot be trusted: said once, on every node. (Only
root can fix it: nothing of ptcluster's, ``setup`` included, changes the system's /run/lock.)"""


def untrusted_lease_dir(exc: OSError) -> GuardError:
    """The refusal when the lease directory is missing (and we are not root, who makes it) or
    is not root's sticky directory: a job never runs unleased unless its user said so."""
    return GuardError(f"no lease directory to trust: {exc.strerror or exc}", UNLEASED_FIX)


def unleasable(what: str, exc: OSError) -> GuardError:
    """The refusal when the lease directory exists but cannot be used (a file in it refused)."""
    return GuardError(f"cannot lease {what}in {LEASE_DIR}: {exc}", UNLEASED_FIX)
