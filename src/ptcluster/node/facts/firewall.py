"""The node's firewall, one model for the doctor and setup: which manager (ufw, firewalld), whether
it is active, and the rules ptcluster cares about (ufw's added rules, firewalld's trusted
sources: what setup opens for the other nodes), read as root where root is at hand; plus the
rule counts of nftables and iptables (the doctor's view of what might drop a connection).

Standard library only; a part of the doctor's probe and of setup's node program (shipped by
``remote.bootstrap``). Each reader is a command and its parse; the caller runs the commands (its
runner, and as root the way its node allows).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from typing import TypedDict

Command = Callable[[list[str]], tuple[int, str]]
"""Runs a command: ``(exit status, stdout and stderr)``."""
UFW_ADDED = ("ufw", "show", "added")
"""ufw's rules as its own command syntax: one call (ufw is slow to start)."""
UFW_CONF = "/etc/ufw/ufw.conf"


def ufw_installed() -> bool:
    return bool(shutil.which("ufw")) or os.path.exists("/usr/sbin/ufw")


def ufw_enabled() -> bool:
    """Whether ufw is on (its config says so: readable without root)."""
    try:
        with open(UFW_CONF) as f:
            conf = f.read()
    except OSError:
        conf = ""
    return ufw_installed() and bool(re.search(r"^\s*ENABLED\s*=\s*yes", conf, re.M))


class FirewallState(TypedDict, total=False):
    """The firewall's model: setup's ``firewall`` section (``setup.plan`` reads it), and part
    of doctor's ``firewall`` (``node.doctor_facts.FirewallFacts``)."""

    kind: str | None
    """``ufw``, ``firewalld``, or None (neither is there)."""
    active: bool
    rules: list[str] | None
    """ufw's added rules, or firewalld's trusted sources; None when they could not be read."""
    why: str
    """Why the rules could not be read (ufw's)."""


class RuleCounts(TypedDict, total=False):
    """What :func:`rule_counts` could count (each only when it was read)."""

    nft_rules: int
    nft_drop: int
    iptables_rules: int


def firewall_state(run: Command, as_root: Command | None) -> FirewallState:
    """``{kind: "ufw" | "firewalld" | None, active, rules, why}``: ``rules`` None when they could
    not be read (``as_root`` None: no root here; ``why`` says)."""
    if ufw_installed():
        enabled = ufw_enabled()
        if as_root is None:
            return {"kind": "ufw", "active": enabled, "rules": None,
                    "why": "reading ufw's rules needs root"}
        if not enabled:
            return {"kind": "ufw", "active": False, "rules": []}
        code, added = as_root(list(UFW_ADDED))
        rules = [line.strip() for line in added.splitlines() if line.startswith("ufw ")]
        return {"kind": "ufw", "active": enabled, "rules": rules if code == 0 else None,
                "why": "" if code == 0 else added.strip()[-200:]}
    if shutil.which("firewall-cmd"):
        code, out = run(["firewall-cmd", "--state"])
        active = code == 0 and "running" in out
        sources: list[str] | None = None
        if active and as_root is not None:
            _, listed = as_root(["firewall-cmd", "--zone=trusted", "--list-sources"])
            sources = listed.split()
        return {"kind": "firewalld", "active": active, "rules": sources}
    return {"kind": None, "active": False, "rules": []}


def rule_counts(run: Command) -> RuleCounts:
    """nftables' rules (and its drop/reject rules) and iptables' appended rules, where this user
    may list them (root): ``{nft_rules, nft_drop, iptables_rules}``, each only when read."""
    info: RuleCounts = {}
    code, out = run(["nft", "list", "ruleset"])
    if code == 0:
        info["nft_rules"] = sum(1 for line in out.splitlines()
                                if line.strip() and not line.strip().startswith(
                                    ("table", "chain", "type", "}", "policy")))
        info["nft_drop"] = sum(1 for line in out.splitlines() if " drop" in line
                               or "reject" in line)
    code, out = run(["iptables", "-S"])
    if code == 0:
        info["iptables_rules"] = sum(1 for line in out.splitlines() if line.startswith("-A"))
    return info
