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
