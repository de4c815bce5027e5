"""Why the head could not reach a node, or start a node's program: the channel's diagnoses of
ssh's, Slurm's and the shell's last words (``transport.explain_channel_failure``) and of a local
process that would not start (``explain_start_failure``), declared as data with their codes
(``node.*``: ``node.problems``). ``{detail}`` is the last line the failed command printed (or
its exit status): the evidence, always shown.
"""

from __future__ import annotations

from ptcluster.node.problems import Declared

FRAME_TOO_LONG = Declared(
    "node.frame-too-long", "the node sent a line too long",
    "frame too long: {detail}",
    "check the node: its ptcluster programs never send such a line, so something else speaks on "
    "its channel (a login script's output, or a compromised node)")
NO_PYTHON_AUTO = Declared(
    "node.no-python", "no python on the node",
    "no python: neither {setup_python} (made by `ptcluster setup`) nor the head's {head_python} "
    "is there ({detail})",
    "run `ptcluster setup`, or set python: to an interpreter that exists there")
SRUN_REFUSED = Declared(
    "node.srun-refused", "Slurm could not run the node's step",
    "Slurm could not run the node's step ({detail})",
    "check that the allocation still runs (squeue -j $SLURM_JOB_ID); outside one, unset "
    "SLURM_JOB_ID or pass --cluster")
PYTHON_NOT_FOUND = Declared(
    "node.python-not-found", "python not found on the node",
    "python not found or not executable at {python} ({detail})",
    "set python: (cluster-wide or for this node) to an interpreter that exists there")
KEY_REFUSED = Declared(
    "node.ssh-key-refused", "ssh refused the key",
    "ssh refused the key ({detail})",
    "install your key on the node: ssh-copy-id, or `ptcluster setup`")
HOST_KEY = Declared(
    "node.host-key-untrusted", "the node's host key is not trusted",
    "host key not trusted ({detail})",
    "ssh to the node once by hand and check the fingerprint (we never turn host-key checking "
    "off)")
UNRESOLVED = Declared(
    "node.host-unresolved", "the host name does not resolve",
    "cannot resolve the host ({detail})",
    "fix the host name or use its IP address")
UNREACHABLE = Declared(
    "node.ssh-unreachable", "the node cannot be reached over ssh",
    "cannot reach the node over ssh ({detail})",
    "check the node is up, the address is right and sshd runs (port 22 or ssh.port)")
COMMAND_FAILED = Declared(
    "node.command-failed", "the node's command failed",
    "the node's command failed ({detail})",
    "run `ptcluster doctor` for details")
CHANNEL = (FRAME_TOO_LONG, NO_PYTHON_AUTO, SRUN_REFUSED, PYTHON_NOT_FOUND, KEY_REFUSED, HOST_KEY,
           UNRESOLVED, UNREACHABLE, COMMAND_FAILED)
"""A node command that died before it said anything useful: the first that fits, in order."""

TOO_MANY_FILES = Declared(
    "node.too-many-open-files", "the head has no file descriptors left",
    "cannot start {program} here: too many open files (the head's limit is {limit})",
    "raise the open-files limit (ulimit -n; the hard limit: /etc/security/limits.conf), or run "
    "on fewer nodes")
NO_SSH = Declared(
    "node.no-ssh-client", "no ssh client here",
    "cannot start {program} here: {error}",
    "install the OpenSSH client (apt-get install openssh-client)")
NO_SRUN = Declared(
    "node.no-srun", "no srun here",
    "cannot start {program} here: {error}",
    "run ptcluster where Slurm's clients are installed, or pass --cluster outside an allocation")
NO_LOCAL_PYTHON = Declared(
    "node.no-local-python", "the local python does not start",
    "cannot start {program} here: {error}",
    "set python: to an interpreter that exists")
START = (TOO_MANY_FILES, NO_SSH, NO_SRUN, NO_LOCAL_PYTHON)
"""A channel's local process (ssh, srun, a local python) that cannot be started at all."""
COMPROMISED = "a node that sends this may be compromised"
FACTS_REFUSED = Declared(
    "node.facts-refused", "a value of a node's facts is refused",
    "the node's facts are refused: {where} is {value}, not {want}",
    f"check that node (what it sends goes into files root writes on every node; {COMPROMISED})")
DOCTOR_FACTS_REFUSED = Declared(
    "node.doctor-facts-refused", "a value of a node's doctor facts is refused",
    "the node's doctor facts are refused: {where} is {value}, not {want}",
    f"check that node ({COMPROMISED})")
ANSWER_REFUSED = Declared(
    "node.answer-refused", "a value of a node program's answer is refused",
    "{where} is {value}, not {want}", f"check that node ({COMPROMISED})")
SAMPLE_REFUSED = Declared(
    "node.sample-refused", "a value of a node's sample is refused",
    "the node's sample is refused: {where} is {value}, not {want}",
    f"check that node's sampler ({COMPROMISED})")
RECORD_REFUSED = Declared(
    "node.record-refused", "a value of a record a rank reported is refused",
    "the rank's record is refused: {where} is {value}, not {want}",
    "use the same ptcluster version on the head and on every node (the bench worker and the "
    "step probe write these records)")
HOSTNAME_REFUSED = Declared(
    "node.hostname-refused", "a node's hostname is not a DNS name",
    "the node says its hostname is {hostname!r}, which is not a DNS name: setup writes no name "
    "of a node until it is one",
    "give the node a hostname of letters, digits, '-' and '.' (hostnamectl set-hostname NAME)")
REPLIES = (FACTS_REFUSED, DOCTOR_FACTS_REFUSED, ANSWER_REFUSED, SAMPLE_REFUSED, RECORD_REFUSED,
           HOSTNAME_REFUSED)
"""A node's reply the head does not believe (``remote.replies.BadReply``): a value of the
wrong type or range, said of the kind of reply it came in."""
TABLE = CHANNEL + START + REPLIES
