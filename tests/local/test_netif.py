"""The node's addresses (``node.facts.netif``): ``ip -j`` where iproute2 has it, and on an
iproute2 older than 4.13 (no ``-j``) the guard still finds its interface's address from
``ip -o -4``. That iproute2 cannot run here: an ``ip`` that answers as it does stands in for it,
first on PATH."""

from __future__ import annotations

import json
import os
import stat

import pytest

from ptcluster.node.facts import netif

ONELINE = """1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
2: eth0@if7    inet 10.9.0.2/24 brd 10.9.0.255 scope global eth0\\       valid_lft forever
2: eth0@if7    inet 10.9.0.3/24 scope global secondary eth0\\       valid_lft forever
"""
JSON = [{"ifname": "lo", "flags": ["LOOPBACK", "UP"], "operstate": "UNKNOWN",
         "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
        {"ifname": "eth0", "flags": ["BROADCAST", "UP"], "operstate": "UP",
         "addr_info": [{"family": "inet6", "local": "fe80::1", "prefixlen": 64},
                       {"family": "inet", "local": "10.9.0.2", "prefixlen": 24}]}]


def test_both_listings_parse_to_the_same_addresses() -> None:
    assert netif.parse_ip_oneline(ONELINE) == [
        ("lo", "127.0.0.1"), ("eth0", "10.9.0.2"), ("eth0", "10.9.0.3")]
    assert netif.parse_ip_addr(json.dumps(JSON)) == [
        {"name": "lo", "up": True, "ipv4": ["127.0.0.1/8"]},
        {"name": "eth0", "up": True, "ipv4": ["10.9.0.2/24"]}]


@pytest.fixture
def old_iproute2(tmp_path, monkeypatch):
    """``ip`` as iproute2 < 4.13 answers: no ``-j``; ``-o -4 addr show`` as recorded."""
    (tmp_path / "oneline").write_text(ONELINE)
    ip = tmp_path / "ip"
    ip.write_text("#!/bin/sh\n"
                  'case "$1" in -j) echo \'Option "-j" is unknown, try "ip -help".\' >&2; '
                  "exit 255;; esac\n"
                  f'[ "$*" = "-o -4 addr show" ] && exec cat {tmp_path / "oneline"}\nexit 1\n')
    ip.chmod(ip.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_without_ip_j_the_guard_still_finds_its_address(old_iproute2) -> None:
    links, why = netif.interfaces()
    assert links == [] and why is not None and "-j" in why  # the doctor says why
    assert netif.address_on("eth0") == "10.9.0.2"
    assert netif.interface_holding("10.9.0.3") == "eth0"
    assert netif.address_on("eth9") == ""
