"""Pure unit tests: tables and fakes, no process, no network, no testbed. Enforced: a test here
that starts a process fails (it belongs in ``tests/local/``)."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError(f"{request.node.nodeid} starts a process ({args!r:.120}): "
                             "a unit test may not; move it to tests/local/")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
