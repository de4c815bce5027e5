"""What a cluster file may set without the user vouching for it.

A cluster file is configuration, and one is picked up from the current directory: typing
``ptcluster doctor`` in a cloned repository reads that repository's ``cluster.yaml``. Such a file
must not be able to run a program on this machine or to weaken ssh's checks, so, as
``direnv`` does with ``.envrc``, the settings that can are refused unless the user says the file
is theirs (``--trust-cluster-file``, or ``PTCLUSTER_TRUST_CLUSTER_FILE=1``).

ssh options are allowed by name (an allow-list, not a deny-list): OpenSSH keeps adding options
that run programs (``KnownHostsCommand`` in 8.5, ``SecurityKeyProvider`` in 8.2), and a list of
the dangerous ones would fall behind without a sound; an option not known to be harmless is
refused until someone looks at it. Allowed are those that only tune how the connection is
made; ``ProxyJump`` (a chain of ssh hops, validated as hosts) stays allowed.
``~/.ssh/config`` is the user's own and applies as always; ``ssh.config_file`` replaces it with
a file in ssh's own language (``Match exec``, ``Include``, ``ProxyCommand``) that ptcluster does
not parse, so one outside ``~/.ssh`` needs trust too.

``python:`` starts every node program (``doctor``, ``ps``, ``monitor``, ``kill`` too, and a node
may be this machine): one inside the cluster file's own directory is the repository's code
(a script, or a venv whose ``.pth`` files run at start), so it needs trust; any other
interpreter (``auto``, a name on the node's PATH, ``/opt/venv/bin/python``) is configuration.
``requirements:`` (or ``--requirements``) names the project's environment: reading it runs
nothing, but a file that names another index (or folder of links) chooses where this machine
fetches code from, and a package with no wheel would be built here from its sdist, running its
code: both need trust (``venvs.resolve.check_trust``, ``venvs.fetch``); with trust, they are
the user's choice.
``data:`` pushes folders of this machine to the hosts the file names (a cloned repository's
file could name ``~/.ssh`` and a host of its author's): refused until the user vouches for the
file (``data_risk``); ``push SRC`` and ``run --data`` on the command line are the user's own.
A ``spares:`` entry is read as a ``nodes:`` entry is (its ``python:`` and ``ssh`` by the same
rules): a spare is a node that waits.
``env:`` is not refused: it reaches the ranks of ``run``, jobs on the nodes the file describes,
and ``run`` runs the project's own code there by design (a cloned repository's ``train.py`` is
as much its author's code as its cluster file). ``doctor``'s and ``bench``'s ranks run
ptcluster's own code: they get ``env:`` only from a file the user vouched for
(``cli.common.spec_for_our_ranks``).
"""

from __future__ import annotations

import os
import re

from ptcluster.cluster.model import AUTO_PYTHON
from ptcluster.cluster.validate import USER_NAME, is_host

TRUST_FLAG = "--trust-cluster-file"
TRUST_ENV_VAR = "PTCLUSTER_TRUST_CLUSTER_FILE"
TRUST_IT = f"if you wrote this file, pass {TRUST_FLAG} (or set {TRUST_ENV_VAR} to its path)"

SAFE_SSH_OPTIONS = frozenset(name.lower() for name in (
    "AddressFamily", "BatchMode", "BindAddress", "BindInterface", "CanonicalDomains",
    "CanonicalizeFallbackLocal", "CanonicalizeHostname", "CanonicalizeMaxDots",
    "CanonicalizePermittedCNAMEs", "CASignatureAlgorithms", "CertificateFile", "CheckHostIP",
    "Ciphers", "Compression", "ConnectionAttempts", "ConnectTimeout", "FingerprintHash",
    "GSSAPIAuthentication", "HashKnownHosts", "HostbasedAcceptedAlgorithms",
    "HostbasedAuthentication", "HostKeyAlgorithms", "Hostname", "IdentitiesOnly",
    "IdentityFile", "IPQoS", "KbdInteractiveAuthentication", "KexAlgorithms", "LogLevel", "MACs",
    "NumberOfPasswordPrompts", "PasswordAuthentication", "Port", "PreferredAuthentications",
    "ProxyJump", "PubkeyAcceptedAlgorithms", "PubkeyAcceptedKeyTypes", "PubkeyAuthentication",
    "RekeyLimit", "RequiredRSASize", "RevokedHostKeys", "ServerAliveCountMax",
    "ServerAliveInterval", "StrictHostKeyChecking", "TCPKeepAlive", "UpdateHostKeys", "User",
    "VisualHostKey",
))
"""Options that only tune how the connection is made (``man ssh_config``, OpenSSH 9.x)."""

_RUNS_CODE = frozenset(name.lower() for name in (
    "ProxyCommand", "LocalCommand", "PermitLocalCommand", "KnownHostsCommand", "RemoteCommand",
    "PKCS11Provider", "SecurityKeyProvider", "SmartcardDevice", "XAuthLocation",
    "EnableSSHKeysign",
))
_HOST_KEYS = frozenset(name.lower() for name in (
    "StrictHostKeyChecking", "UserKnownHostsFile", "GlobalKnownHostsFile",
    "NoHostAuthenticationForLocalhost", "HostKeyAlias", "VerifyHostKeyDNS", "KnownHostsCommand",
))
_CHECKING_ON = ("yes", "true", "ask")
"""``accept-new`` is not among them: it trusts whatever answers at a new host the first time
(L7); the cluster file must be trusted for it."""
_PORT = re.compile(r"^[0-9]{1,5}$")


def ssh_option_risk(name: str, value: str) -> str:
    """Why the ssh option ``name=value`` needs a trusted file ("" when it does not)."""
    key = name.lower()
    if key in _RUNS_CODE:
        return "runs a program on this machine"
    if key == "stricthostkeychecking" and value.lower() not in _CHECKING_ON:
        return f"{value!r} switches host-key checking off"
    if key in _HOST_KEYS and key != "stricthostkeychecking":
        return "changes which host keys ssh trusts"
    if key not in SAFE_SSH_OPTIONS:
        return ("is not among the options known only to tune the connection (others may "
                "forward your agent, open ports, or load code)")
    if key == "proxyjump" and not proxy_jump_ok(value):
        return f"{value!r} is not a list of [user@]host[:port] hops"
    if key == "hostname" and not is_host(value):
        return f"{value!r} is not a hostname or an IP address"
    if key == "user" and not USER_NAME.match(value):
        return f"{value!r} is not a user name"
    return ""


def proxy_jump_ok(value: str) -> bool:
    """``none``, or ``[ssh://][user@]host[:port]`` hops separated by commas."""
    if value.lower() == "none":
        return True
    for hop in value.split(","):
        hop = hop.removeprefix("ssh://")
        user, at, hostport = hop.rpartition("@")
        if at and not USER_NAME.match(user):
            return False
        if hostport.startswith("["):
            host, _, rest = hostport[1:].partition("]")
            port = rest.removeprefix(":") if rest.startswith(":") else None
            if rest and port is None:
                return False
        elif hostport.count(":") == 1:
            host, port = hostport.split(":")
        else:
            host, port = hostport, None
        if not is_host(host):
            return False
        if port is not None and not (_PORT.match(port) and 0 < int(port) < 65536):
            return False
    return True


def config_file_risk(path: str) -> str:
    """Why ``ssh.config_file: path`` needs a trusted file ("" for ``none`` or a file in
    ~/.ssh, the user's own place, which a cloned repository cannot write)."""
    if path == "none":
        return ""
    ssh_dir = os.path.realpath(os.path.expanduser("~/.ssh"))
    real = os.path.realpath(os.path.expanduser(path))
    if os.path.commonpath([ssh_dir, real]) == ssh_dir and real != ssh_dir:
        return ""
    return ("replaces ~/.ssh/config with a file in ssh's own language, which may run "
            "programs (ProxyCommand, Match exec, LocalCommand) and is not checked here")


def python_risk(python: str, code_dir: str) -> str:
    """Why ``python: python`` in a cluster file kept in ``code_dir`` needs a trusted file (""
    when it does not): a program inside that directory (as ssh's remote shell finds it: a
    relative path in the home directory). The last link is not followed: a venv's python
    links to the system's, but the venv (its site-packages) is what runs. A file kept in the
    home directory (or above it) is not a repository's: the rule would claim all of the
    user's own files."""
    if python == AUTO_PYTHON or "/" not in python:
        return ""
    home = os.path.realpath(os.path.expanduser("~"))
    path = os.path.join(home, os.path.expanduser(python))
    real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    top = os.path.realpath(code_dir)
    if os.path.commonpath([top, real]) != top or os.path.commonpath([top, home]) == top:
        return ""
    return (f"{python} is inside {top}, the cluster file's own directory: its code (a script, "
            "or a venv whose .pth files run at start) would run on every node for every "
            "command")


def data_risk() -> str:
    """Why a ``data:`` entry needs a trusted file."""
    return ("it sends folders of this machine to the hosts this file names (a file you did "
            "not write could name your keys and someone else's host)")
