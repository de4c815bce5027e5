"""Small validators shared by the cluster file, hostfiles and ``--hosts``.

Each returns the cleaned value or raises :class:`SpecError` naming the source, key path and fix.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from typing import Any

from ptcluster.errors import SpecError

_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
USER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?$")
_SSH_OPTION = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")
_SCOPE_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
"""An IPv6 zone (``fe80::1%eth0``): an interface name or number (``ipaddress`` takes any text)."""

# Variables the launcher owns: setting them in `env` would silently fight the rendezvous.
RESERVED_ENV = {
    "MASTER_ADDR": "set master.addr",
    "MASTER_PORT": "set master.port (or pass --port)",
    "WORLD_SIZE": "set slots on each node",
    "RANK": "ranks follow the order of nodes",
    "LOCAL_RANK": "ranks follow the order of nodes",
    "NODE_RANK": "ranks follow the order of nodes",
    "GROUP_RANK": "ranks follow the order of nodes",
    "LOCAL_WORLD_SIZE": "set slots on each node",
    "NCCL_SOCKET_IFNAME": "set interface (cluster-wide or per node)",
    "GLOO_SOCKET_IFNAME": "set interface (cluster-wide or per node)",
}


def is_host(value: str) -> bool:
    """True for an IPv4/IPv6 address or an RFC 1123 hostname (no shell metacharacters: a host
    is echoed into ``ptcluster env``'s output and handed to ssh)."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        pass
    else:
        _, sep, scope = value.partition("%")
        return not sep or bool(_SCOPE_ID.match(scope))
    if not value or len(value) > 253:
        return False
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    return all(_HOST_LABEL.match(label) for label in labels)


def is_dns_name(value: object) -> bool:
    """True for a DNS name only: RFC 1123 labels (each whole: no newline passes), not an IP
    address, the last label not all digits (``1.2.3`` would be read as an address by
    ``inet_aton``). What a node says its name is must be one before it is written into another
    node's ``/etc/hosts``."""
    if not isinstance(value, str) or not 0 < len(value) <= 253:
        return False
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    return all(_HOST_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    return "allowed: " + ", ".join(choices)


class Reader:
    """Walks a parsed YAML tree, keeping the key path for error messages."""

    def __init__(self, source: str, trusted: bool = False, code_dir: str | None = None) -> None:
        self.source = source
        self.trusted = trusted
        """Whether the user vouched for the file (``cluster.trust``): it may then set what runs
        code on this machine."""
        self.code_dir = code_dir
        """The directory the file came with (a repository's), whose programs need trust."""

    def fail(self, path: str, problem: str, fix: str | None = None) -> SpecError:
        return SpecError(self.source, path, problem, fix)

    def mapping(self, value: Any, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping of keys, got {_kind(value)}",
                            "write it as `key: value` lines, allowed keys: " + ", ".join(allowed))
        for key in value:
            if not isinstance(key, str) or key not in allowed:
                raise self.fail(_join(path, str(key)), "unknown key",
                                did_you_mean(str(key), allowed))
        return value

    def host(self, value: Any, path: str) -> str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not is_host(value.strip()):
            raise self.fail(path, f"{value!r} is not a valid hostname or IP address",
                            "use a DNS name (letters, digits, '-', '.') or an IP address")
        return value.strip()

    def integer(self, value: Any, path: str, lo: int, hi: int, fix: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"must be an integer, got {_kind(value)} {value!r}", fix)
        if not lo <= value <= hi:
            bound = f">= {lo}" if hi >= 2**31 else f"between {lo} and {hi}"
            raise self.fail(path, f"must be {bound}, got {value}", fix)
        return value

    def port(self, value: Any, path: str) -> int:
        return self.integer(value, path, 1, 65535, "use a TCP port between 1 and 65535")

    def slots(self, value: Any, path: str) -> int:
        return self.integer(value, path, 1, 2**31,
                            "set slots to the number of processes for this node (>= 1)")

    def text(self, value: Any, path: str, what: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(path, f"must be a non-empty string ({what}), got {_kind(value)}",
                            f"set it to {what}")
        if "\0" in value or "\n" in value:
            raise self.fail(path, "must not contain newlines or NUL bytes", f"set it to {what}")
        return value.strip()

    def interface(self, value: Any, path: str) -> str:
        name = self.text(value, path, "a network interface name such as eth0")
        if not _IFNAME.match(name):
            raise self.fail(path, f"{name!r} is not a valid network interface name",
                            "use the name `ip -br link` shows, e.g. eth0 or ens33")
        return name

    def user(self, value: Any, path: str) -> str:
        name = self.text(value, path, "a login name")
        if not USER_NAME.match(name):
            raise self.fail(path, f"{name!r} is not a valid user name", "use a plain login name")
        return name

    def scalar(self, value: Any, path: str) -> str:
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, (int, float, str)):
            text = str(value)
            if "\0" in text:
                raise self.fail(path, "must not contain NUL bytes", "remove them")
            return text
        raise self.fail(path, f"must be a string or number, got {_kind(value)}",
                        "quote the value as a string")

    def env(self, value: Any, path: str) -> tuple[tuple[str, str], ...]:
        if value is None:
            return ()
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping NAME: value, got {_kind(value)}",
                            "write it as `env: {NCCL_DEBUG: WARN}`")
        out = []
        for name, item in value.items():
            key = _join(path, str(name))
            if not isinstance(name, str) or not _ENV_NAME.match(name):
                raise self.fail(key, f"{name!r} is not a valid environment variable name",
                                "use letters, digits and '_', not starting with a digit")
            if name in RESERVED_ENV:
                raise self.fail(key, f"{name} is set by ptcluster for every rank",
                                RESERVED_ENV[name])
            out.append((name, self.scalar(item, key)))
        return tuple(out)

    def ssh_options(self, value: Any, path: str) -> tuple[tuple[str, str], ...]:
        if value is None:
            return ()
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping Option: value, got {_kind(value)}",
                            "write it as `options: {ServerAliveInterval: 5}`")
        out = []
        for name, item in value.items():
            key = _join(path, str(name))
            if not isinstance(name, str) or not _SSH_OPTION.match(name):
                raise self.fail(key, f"{name!r} is not an ssh option name",
                                "use names from `man ssh_config`, e.g. ServerAliveInterval")
            text = self.scalar(item, key)
            if isinstance(item, bool):
                text = "yes" if item else "no"
            if "\n" in text:
                raise self.fail(key, "must be a single line", "remove the newline")
            out.append((name, text))
        return tuple(out)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)
