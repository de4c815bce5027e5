"""The guard's refusal (``GuardError``, sent to the head as ``error {problem, fix, code, fields,
busy, unhealthy, environment}``: the head's ``GuardRefused``), raised by its prechecks and its
choice of GPUs. Every refusal is declared below (``TABLE``: code ``guard.*``, text, fix) and
raised by its entry with named values (``refuse``); the health gate's have their own table.

Its ``problem`` and ``fix`` are plain strings, not ``ptcluster.errors.Problem``: this module is
shipped (it cannot import the head's package), and the frame is JSON anyway. The head makes the
one ``Problem`` of them where it decodes the frame (``launch.supervise.events``).

Standard library only; a part of the guard (shipped by ``remote.bootstrap``).
"""

from __future__ import annotations

from ptcluster.node.problems import Declared
from ptcluster.node.sharing.leases import LEASE_DIR


class GuardError(Exception):
    """The guard refuses: what is wrong on this node, and the fix; ``code`` names the declared
    refusal (``TABLE``, or the health gate's ``node.facts.health.REFUSALS``) and ``fields`` the
    values its text was filled with, which the frame carries too."""

    def __init__(self, problem: str, fix: str, busy: bool = False,
                 unhealthy: bool = False, environment: str = "", code: str | None = None,
                 fields: dict[str, str] | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix
        self.code = code
        self.fields = fields or {}
        self.busy = busy
        """Refused only because another job holds what this one asks for (it may wait)."""
        self.unhealthy = unhealthy
        """Refused by the health gate (``node.facts.health``): a restart leaves the node out."""
        self.environment = environment
        """``missing`` or ``changed``: the project's environment the head expected is not
        ready here (``prechecks.project_environment``): the head ships and builds it, then
        launches again."""

    def frame(self) -> dict[str, object]:
        """The ``error`` frame's body that says this refusal to the head."""
        return {"problem": self.problem, "fix": self.fix, "busy": self.busy,
                "unhealthy": self.unhealthy, "environment": self.environment,
                "code": self.code, "fields": self.fields}


def refuse(entry: Declared, /, *, busy: bool = False, environment: str = "",
           **values: object) -> GuardError:
    """The refusal ``entry`` declares, its fields filled in by name."""
    what, fix = entry.texts(**values)
    return GuardError(what, fix, busy=busy, environment=environment, code=entry.code,
                      fields={k: str(v) for k, v in values.items()})


UNLEASED_FIX = (f"have root make {LEASE_DIR} what Debian and Ubuntu make it at every boot, a "
                f"directory of root's with mode 1777 (`install -d -m 1777 -o root -g root "
                f"{LEASE_DIR}`), or pass `run --no-leases` to run without leases (unsafe: other "
                "jobs may take this job's GPUs and port, and `ps` and `kill` do not see it "
                "there)")
"""What to do about a lease directory that cannot be trusted: said once, on every node. (Only
root can fix it: nothing of ptcluster's, ``setup`` included, changes the system's /run/lock.)"""

NO_RANK_PROGRAMS = Declared(
    "guard.no-rank-programs", "the guard came without its rank programs",
    "this guard was started without the rank programs it hands on",
    "start it through the head (remote.bootstrap packs it)")
TMP_UNUSABLE = Declared(
    "guard.tmp-unusable", "the guard's temp directory cannot be used",
    "the guard's temp directory cannot be used: {error}",
    "remove {path} (its owner or root can): a directory of this name must be yours alone, "
    "mode 700")
WORKDIR_MISSING = Declared(
    "guard.workdir-missing", "the workdir is missing on the node",
    "workdir {workdir} does not exist on this node",
    "create it, or set workdir: to a directory present on every node")
ENVIRONMENT_NOT_READY = Declared(
    "guard.environment-not-ready", "the project's environment is missing or changed",
    "the project's environment {digest} is {state} on this node{why}",
    "run again with the same requirements: ptcluster ships and builds it before any rank starts")
SCRIPT_MISSING = Declared(
    "guard.script-missing", "the script is not on the node",
    "script {script} not found in {workdir} on this node",
    "copy the project to every node (a shared filesystem, or `ptcluster sync`), or check the "
    "path")
MODULE_MISSING = Declared(
    "guard.module-missing", "the module is not found on the node",
    "module {module} not found by {python} on this node (workdir {workdir})",
    "install it into that interpreter on every node, or run from the directory that contains it")
NOT_A_JOB_ID = Declared(
    "guard.not-a-job-id", "not a job id",
    "{job_id} is not a job id", "start the job with ptcluster run (it makes the id)")
JOB_RUNS = Declared(
    "guard.job-runs", "the job already runs on the node",
    "job {job_id} already runs on this node",
    "start the job once (a job id is the head's, per run)")
JOB_LEASE_HELD = Declared(
    "guard.job-lease-held", "another holds the job's lease",
    "job {job_id}'s lease on this node is held by {holder}",
    "wait for it to end (run --wait), or start the job again: a new run gets a new job id")
PORT_IN_USE = Declared(
    "guard.port-in-use", "the master port is bound on the node",
    "master port {port} is already in use on this node ({why})",
    "set master.port: auto (every job takes a free port), or pass --port with a free port")
PORT_LEASED = Declared(
    "guard.port-leased", "another job holds the master port",
    "master port {port} is in use on this node by {holder}",
    "set master.port: auto (every job takes a free port), or wait for that job to end "
    "(run --wait)")
NO_FREE_PORT = Declared(
    "guard.no-free-port", "no free port for the rendezvous",
    "no free port in {low}-{high} on this node for the rendezvous",
    "end some jobs, or set master.port to a free port")
GPU_NOT_THERE = Declared(
    "guard.gpu-not-there", "gpus: names a GPU the node does not have",
    "gpus: {want} names GPU {missing}, which this node does not have (it has {count}: {have})",
    "list this node's GPUs in gpus:, or use gpus: auto")
GPUS_BUSY = Declared(
    "guard.gpus-busy", "the GPUs asked for are in use",
    "{need} GPU(s) asked for, {free} free: {held}",
    "wait for them (run --wait){other}{ask}")
LEASE_DIR_UNTRUSTED = Declared(
    "guard.lease-dir-untrusted", "no lease directory to trust",
    "no lease directory to trust: {error}", UNLEASED_FIX)
LEASE_REFUSED = Declared(
    "guard.lease-refused", "a lease cannot be taken",
    "cannot lease {what}in " + LEASE_DIR + ": {error}", UNLEASED_FIX)
POOL_LOST = Declared(
    "guard.pool-lost", "the warm pool could not fork the node's ranks beside the others'",
    "this node's warm pool could not fork its ranks ({why}) after the other nodes' pools had "
    "forked theirs; pooled and cold ranks never meet in one rendezvous, so they could not "
    "start cold here",
    "nothing to do: ptcluster launches the attempt again with every node's ranks cold (not "
    "counted as a restart); if it recurs, run with --cold")
TABLE = (NO_RANK_PROGRAMS, TMP_UNUSABLE, WORKDIR_MISSING, ENVIRONMENT_NOT_READY, SCRIPT_MISSING,
         MODULE_MISSING, NOT_A_JOB_ID, JOB_RUNS, JOB_LEASE_HELD, PORT_IN_USE, PORT_LEASED,
         NO_FREE_PORT, GPU_NOT_THERE, GPUS_BUSY, LEASE_DIR_UNTRUSTED, LEASE_REFUSED, POOL_LOST)
"""Every refusal of a guard but the health gate's (its own table, ``node.facts.health.REFUSALS``,
sent with ``unhealthy``): before any rank starts, and the warm pool lost as its ranks would
start (``POOL_LOST``)."""


def untrusted_lease_dir(exc: OSError) -> GuardError:
    """The refusal when the lease directory is missing (and we are not root, who makes it) or
    is not root's sticky directory: a job never runs unleased unless its user said so."""
    return refuse(LEASE_DIR_UNTRUSTED, error=exc.strerror or exc)


def unleasable(what: str, exc: OSError) -> GuardError:
    """The refusal when the lease directory exists but cannot be used (a file in it refused)."""
    return refuse(LEASE_REFUSED, what=what, error=exc)
