"""Tests on testbed nodes: network namespaces with their own sshd (``support/testbed.py``), bare
nodes with their own root file systems (``support/bare.py``) and a real Slurm
(``support/slurmbed.py``). They need root; elsewhere they skip, in CI they fail
(``support.testbed.bring_up``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def testbed():
    """A 3-node namespace testbed shared by a test module (torn down even on failure).

    In CI (CI=true) a testbed that cannot start fails the tests; elsewhere they skip.
    """
    from tests.support.testbed import Testbed, available, bring_up

    bed = bring_up("multi-node testbed", available(), lambda: Testbed(3))
    try:
        yield bed
    finally:
        bed.close()


@pytest.fixture(autouse=True)
def _trusted_cluster_files(monkeypatch):
    """The testbed's cluster files are the tests' own: they name an ssh config file of the
    testbed (its own known hosts), which an untrusted cluster file may not (``cluster.trust``)."""
    monkeypatch.setenv("PTCLUSTER_TRUST_CLUSTER_FILE", "1")
