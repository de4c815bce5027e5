"""Why ``ptcluster setup`` changes a step, cannot do it, or stops on a node, declared as data
(``node.problems``): each with its code (``setup.NAME``), its text and the fix.

A step's reason is a :class:`Reason` (a declared problem with the status it gives the step): the
step's planner says it by its entry with the values by name (``KEY_NOT_AUTHORIZED.step("ssh key",
actions)``); the step's ``why`` is its what, unchanged as the plan and the table show it, and
``setup --json`` gives the code and the fields beside it. A step that is done (ok) is said in
words only, the node's facts (as doctor's passing checks are). Why setup stops on a node (it
cannot log in, the node's channel closed, its hostname is no DNS name) is a plain entry,
raised as ``login.NodeFailure.of``: the node's ``problem`` in ``--json``, with its code.

The docs' page of setup (``scripts/docs_reference.py``) is generated from ``TABLE``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptcluster.errors import Problem
from ptcluster.node.problems import Declared
from ptcluster.setup.steps import BLOCKED, CHANGE, Status, Step, StepAction


@dataclass(frozen=True)
class Reason(Declared):
    """Why a step is a change (apply runs its commands: the fix says what they do) or blocked
    (the fix says who can do it)."""

    status: Status = CHANGE

    def step(self, name: str, actions: tuple[StepAction, ...] = (), /,
             **values: object) -> Step:
        """Step ``name`` with this reason, its fields filled in by name."""
        problem = Problem.of(self, None, **values)
        return Step(name, self.status, problem.what, actions, problem)


def _change(code: str, title: str, what: str, fix: str) -> Reason:
    return Reason(f"setup.{code}", title, what, fix, CHANGE)


def _blocked(code: str, title: str, what: str, fix: str) -> Reason:
    return Reason(f"setup.{code}", title, what, fix, BLOCKED)


def _stop(code: str, title: str, what: str, fix: str) -> Declared:
    return Declared(f"setup.{code}", title, what, fix)


# -- setup's own steps (setup.plan) ------------------------------------------------------------
HEAD_KEY_MISSING = _change("head-key-missing", "the head has no ssh key", "no key at {path}",
                           "setup makes one (ssh-keygen -t ed25519, no passphrase)")
HEAD_KEY_HALF = _blocked(
    "head-key-half", "the head's key has no public half", "{path} exists without {pub}: never "
    "overwritten", "make its public half (ssh-keygen -y -f KEY > KEY.pub), or give another "
    "ssh.identity_file")
KEY_NOT_AUTHORIZED = _change(
    "key-not-authorized", "the head's key is not authorized on the node",
    "the head's key is not in ~/.ssh/authorized_keys", "setup appends it (mode 600)")
SUDO_NEEDS_PASSWORD = _blocked(
    "sudo-needs-password", "sudo needs a password", "sudo needs a password and none was given",
    "run setup at a terminal (it asks once), or pass --password-file FILE (mode 600)")
SUDO_REFUSED_PASSWORD = _blocked(
    "sudo-refused-password", "sudo refused the password", "sudo refused the password",
    "check the password: setup gives sudo the login's")
NO_SUDO = _blocked("no-sudo", "no root on the node", "{why}",
                   "add the user to the sudoers (or log in as root); else an admin runs the "
                   "commands setup shows")
NOT_APT = _blocked(
    "not-apt", "not a Debian or Ubuntu node",
    "{os}: setup knows Debian and Ubuntu only (apt); prepare this node by hand",
    "install what the plan's other steps name by hand, or use Debian or Ubuntu")
NO_DRIVER = _blocked(
    "no-gpu-driver", "GPUs without a driver",
    "{count} NVIDIA GPU(s) but no driver: install it (e.g. `sudo ubuntu-drivers install`) and "
    "reboot; setup never installs drivers",
    "install the NVIDIA driver (sudo ubuntu-drivers install), reboot, and run setup again")
PACKAGES_MISSING = _change("packages-missing", "apt packages missing", "missing: {missing}",
                           "setup installs them with apt, as root")
NEEDS_ROOT = _blocked(
    "needs-root", "a change that needs root, without it",
    "{why}; needs root ({why_not}): an admin can run the commands below",
    "an admin runs the commands shown, or run setup as a user with sudo")
PYTHON_DIFFERS = _blocked(
    "python-differs", "the node's Python is not the head's",
    "the node's python3 is {node}, the head's is {head} (the wheels are the head's): install "
    "python{head} there, or run setup from a head with the nodes' Python",
    "install python{head} on the node, or run setup from a head with the nodes' Python")
VENV_NEEDS_PACKAGES = _blocked(
    "venv-needs-packages", "no venv without python3-venv", "needs python3-venv (apt packages)",
    "install python3-venv (the apt packages step, as root)")
NO_VENV = _change("no-venv", "no working venv", "no working venv at {venv}",
                  "setup makes it (python3 -m venv)")
NO_TORCH_BUILD = _blocked("no-torch-build", "no torch build fits", "{why}",
                          "see the torch line: a --torch-backend, or the nodes' drivers")
WHEELS_NO_VENV = _blocked("wheels-no-venv", "wheels wait for the venv",
                          "not copied: the venv cannot be made (see above)",
                          "fix the python venv step first")
WHEELS_TO_DOWNLOAD = _change(
    "wheels-to-download", "the head downloads the wheels",
    "the head downloads the wheels once, then copies what the node lacks",
    "setup downloads them into the head's wheelhouse (--wheelhouse) and copies them over ssh")
WHEELS_LACKING = _change("wheels-lacking", "wheels to copy",
                         "{lacking} of {total} wheels to copy",
                         "setup copies them from the head's wheelhouse over ssh")
TORCH_NO_VENV = _blocked("torch-no-venv", "torch waits for the venv",
                         "needs the venv (see above)", "fix the python venv step first")
TORCH_INSTALL = _change(
    "torch-install", "the venv lacks torch or ptcluster",
    "{lacks}; want torch {torch} ({why}), ptcluster {ptcluster}",
    "setup installs them with pip from the node's wheelhouse (no index)")
ENV_FILE = _change("env-file", "the env file is not the cluster's", "{path} {state}",
                   "setup writes it")
WORKDIR_MISSING = _change("workdir-missing", "no workdir", "{path} does not exist",
                          "setup makes it (mkdir -p)")
FIREWALL_UNREADABLE = _blocked(
    "firewall-unreadable", "the firewall's rules need root",
    "{kind} is active and its rules need root to read or change: an admin can run the "
    "commands below", "an admin runs the commands shown, or run setup as a user with sudo")
FIREWALL_CLOSED = _change("firewall-closed", "the firewall drops the other nodes",
                          "{kind} active: TCP from {lacking} not allowed",
                          "setup allows TCP from the other cluster nodes only, as root")
HOSTS_BLOCK = _change("hosts-block", "/etc/hosts lacks the cluster's names",
                      "the managed block {state}",
                      "setup writes its marked block in /etc/hosts, as root")
HOSTS_TRAP = _change(
    "hosts-trap", "the node's name maps to 127.x",
    "the managed block {state}; {hostname} maps to 127.x (the 127.0.1.1 trap): that name is "
    "removed", "setup writes its marked block and takes the name off the 127.x line, as root")

# -- --slurm's steps (setup.slurm_steps) -------------------------------------------------------
SLURM_PACKAGES = _change("slurm-packages-missing", "Slurm's packages missing",
                         "missing: {missing} (from the node's own apt sources)",
                         "setup installs them with apt, as root")
MUNGE_KEY_UNREADABLE = _blocked("munge-key-unreadable", "the munge key needs root",
                                "reading /etc/munge/munge.key needs root",
                                "run setup as a user with sudo")
MUNGE_KEY = _change("munge-key", "not the cluster's munge key",
                    "{state}: {source} (sent as the command's input, never shown)",
                    "setup writes the cluster's one key (root, munge's, 0400) and restarts munge")
SERVICE_DISABLED = _change("service-disabled", "a daemon not enabled", "not enabled",
                           "setup enables and restarts it")
SERVICE_STOPPED = _change("service-stopped", "a daemon not running", "not running",
                          "setup enables and restarts it")
SERVICE_STALE = _change("service-stale", "a daemon older than its files",
                        "running since before its files changed", "setup restarts it")
SLURM_FILES = _change("slurm-files", "Slurm's files are not the cluster's", "{files}; {plugins}",
                      "setup writes them (the same on every node)")
SLURM_FILES_WAIT = _blocked(
    "slurm-files-wait", "Slurm's files wait for every node",
    "not every node answered: the cluster's Slurm files need the facts of all of them",
    "make every node of the cluster file answer, then run setup again")
SLURM_FILES_REFUSED = _blocked("slurm-files-refused", "Slurm's files refused", "{why}",
                               "fix what it names on the node, then run setup again")

# -- why setup stops on a node (login.NodeFailure) ---------------------------------------------
NO_ANSWER = _stop("no-answer", "the node did not answer", "no answer within {seconds} s ({kind})",
                  "check the node is up and not overloaded")
CHANNEL_CLOSED = _stop("channel-closed", "the setup channel closed",
                       "the setup channel closed ({last})",
                       "check the node's python3 and ssh (-v shows more)")
BAD_FRAME = _stop("bad-frame", "the node sent a bad frame", "the node sent a bad frame ({error})",
                  "report this bug")
HOST_KEY_CHANGED = _stop(
    "host-key-changed", "the node's host key changed",
    "the node's host key CHANGED since it was last seen",
    "check with the node's admin; if expected, remove the old key (ssh-keygen -R {host}); "
    "setup never accepts a changed key")
HOST_KEY_UNKNOWN = _stop(
    "host-key-unknown", "the node's host key is unknown", "unknown host key {fingerprint}",
    "check the fingerprint with the node's admin, then run again with --accept-new-host-keys")
NO_SSH = _stop("ssh-failed", "the setup program did not start over ssh",
               "cannot start the setup program over ssh ({last})",
               "check the node is up, its address, sshd (port 22 or ssh.port) and that it has "
               "python3")
NO_PASSWORD = _stop(
    "no-password", "the key is not authorized and no password was given",
    "the node does not accept the head's key yet and no password was given",
    "run setup at a terminal (it asks once), or pass --password-file FILE (mode 600)")
PASSWORD_REFUSED = _stop("password-refused", "the node refused the password",
                         "the node refused the password (and the key)",
                         "check the password, and ssh.user in the cluster file")
NO_SSH_CLIENT = _stop("no-ssh-client", "ssh does not start on the head",
                      "cannot start ssh: {error}", "install openssh-client")
BUG = _stop("bug", "setup hit a bug", "setup hit a bug here: {error}",
            "report it with the output of -v")

STEP_REASONS: tuple[Reason, ...] = (
    HEAD_KEY_MISSING, HEAD_KEY_HALF, KEY_NOT_AUTHORIZED, SUDO_NEEDS_PASSWORD,
    SUDO_REFUSED_PASSWORD, NO_SUDO, NOT_APT, NO_DRIVER, PACKAGES_MISSING, NEEDS_ROOT,
    PYTHON_DIFFERS, VENV_NEEDS_PACKAGES, NO_VENV, NO_TORCH_BUILD, WHEELS_NO_VENV,
    WHEELS_TO_DOWNLOAD, WHEELS_LACKING, TORCH_NO_VENV, TORCH_INSTALL, ENV_FILE, WORKDIR_MISSING,
    FIREWALL_UNREADABLE, FIREWALL_CLOSED, HOSTS_BLOCK, HOSTS_TRAP, SLURM_PACKAGES,
    MUNGE_KEY_UNREADABLE, MUNGE_KEY, SERVICE_DISABLED, SERVICE_STOPPED, SERVICE_STALE,
    SLURM_FILES, SLURM_FILES_WAIT, SLURM_FILES_REFUSED)
"""Why a step is a change or blocked, in plan order."""
STOPS: tuple[Declared, ...] = (
    NO_ANSWER, CHANNEL_CLOSED, BAD_FRAME, HOST_KEY_CHANGED, HOST_KEY_UNKNOWN, NO_SSH,
    NO_PASSWORD, PASSWORD_REFUSED, NO_SSH_CLIENT, BUG)
"""Why setup stops on a node (the node's ``problem``; and ``remote.diagnoses.REPLIES``: a reply
of the node's the head does not believe, such as a hostname that is no DNS name)."""
TABLE: tuple[Declared, ...] = STEP_REASONS + STOPS
