from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.procs import job_processes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cli():
    """In-process CLI: returns (exit_code, stdout, stderr)."""
    from click.testing import CliRunner

    from ptcluster.cli import cli as group

    def invoke(*args: str, input: str | None = None):
        runner = CliRunner()
        result = runner.invoke(group, list(args), input=input, catch_exceptions=True)
        code = result.exit_code
        exc = result.exception
        if exc is not None and not isinstance(exc, SystemExit):
            from ptcluster.errors import PtclusterError
            if isinstance(exc, PtclusterError):
                return exc.exit_code, result.stdout, str(exc)
            raise exc
        return code, result.stdout, result.stderr

    return invoke


@pytest.fixture
def ptcluster_cmd():
    return [sys.executable, "-m", "ptcluster"]


@pytest.fixture
def no_leftovers():
    """Yields a list to append job ids to; fails if any of their processes survive."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        left = job_processes(job_id)
        assert not left, f"job {job_id} left processes behind: {left}"


os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture(scope="module")
def testbed():
    """A 3-node namespace testbed shared by a test module (torn down even on failure).

    In CI (CI=true) a testbed that cannot start fails the tests; elsewhere they skip.
    """
    from tests.testbed import Testbed, TestbedError, available

    why = available()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the multi-node testbed: {why}")
        pytest.skip(f"multi-node testbed unavailable: {why}")
    try:
        bed = Testbed(3)
    except TestbedError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the testbed did not start: {exc}")
        pytest.skip(f"the testbed did not start: {exc}")
    try:
        yield bed
    finally:
        bed.close()
