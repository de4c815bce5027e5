"""What the command line itself refuses, declared (``cli.*`` codes, ``node.problems``): usage
that names nothing to do, or options that contradict each other or the cluster in use; and a
gate the command line sets that a measure failed (bench's ``--min-busbw``).

Raised by entry (``UsageError.of(NOTHING_TO_RUN)``); a test reads the code and fields
(``SystemExit.__cause__`` of ``cli.main``), the docs' page the table."""

from __future__ import annotations

from ptcluster.node.problems import Declared

NOTHING_TO_RUN = Declared(
    "cli.nothing-to-run", "run names no program", "nothing to run",
    "give a SCRIPT or -m MODULE, e.g. ptcluster run -m ptcluster.examples.mnist")
NPROC_NOT_LOCAL = Declared(
    "cli.nproc-not-local", "--nproc with a cluster file",
    "--nproc applies to the local cluster only, but {path} is in use",
    "set slots: per node in {path}{otherwise}")
READMIT_WITHOUT_RESTARTS = Declared(
    "cli.readmit-without-restarts", "--readmit without restarts",
    "--readmit takes back nodes that a restart dropped, and there are no restarts",
    "add --max-restarts N (e.g. --max-restarts 3 --readmit)")
NOT_A_JOB_ID = Declared(
    "cli.not-a-job-id", "not a job id", "{job_id} is not a job id",
    "give the id `ptcluster ps` shows (letters, digits, '.', '_', '-')")
SETUP_WITHOUT_CLUSTER = Declared(
    "cli.setup-without-cluster", "setup with no cluster file",
    "setup prepares remote nodes, and no cluster file is in use",
    "pass --cluster FILE (write one with `ptcluster init --hosts ...`)")
NO_RUN_DIR = Declared(
    "cli.no-run-dir", "no such run directory or job", "no run directory {run} (nor {under})",
    "give a run directory or a job id from ./ptcluster-runs")
NO_RUNNING_JOB = Declared(
    "cli.no-running-job", "no job runs under the runs directory",
    "no running job under {runs}/", "start one with `ptcluster run`, or give its run directory")
NO_STACKS = Declared(
    "cli.no-stacks", "the running job gave no stacks", "{run_dir}: no stacks: {error}",
    "try again while the job runs")
BELOW_MIN_BUSBW = Declared(
    "cli.below-min-busbw", "bench measured less than --min-busbw",
    "average bus bandwidth {avg} GB/s is below --min-busbw {min}",
    "find the slow link with `ptcluster bench --pairs`, or lower --min-busbw")
TABLE = (NOTHING_TO_RUN, NPROC_NOT_LOCAL, READMIT_WITHOUT_RESTARTS, NOT_A_JOB_ID,
         SETUP_WITHOUT_CLUSTER, NO_RUN_DIR, NO_RUNNING_JOB, NO_STACKS, BELOW_MIN_BUSBW)
