from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from tests.support.procs import job_processes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """In-process CLI through the real entry point, ``ptcluster.cli.main`` (what the console
    script calls): returns (exit_code, stdout, stderr) as a user would see them.

    stdin is ``input`` (default: empty, and not a terminal). After a call, ``cli.problem`` is
    the problem the command ended with (its ``PtclusterError``'s: the code and fields a test
    asserts), None when it ended without one.
    """
    from ptcluster.cli import main

    def invoke(*args: str, input: str | None = None) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(input or ""))
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            main(list(args))
        out, err = capsys.readouterr()
        code = exited.value.code
        assert code is None or isinstance(code, int), f"exit code {code!r}"
        cause = exited.value.__cause__
        invoke.problem = getattr(cause, "problem", None)  # type: ignore[attr-defined]
        return code or 0, out, err

    invoke.problem = None  # type: ignore[attr-defined]
    return invoke


@pytest.fixture
def console_script() -> Path:
    """The installed ``ptcluster`` command of this interpreter's environment."""
    path = Path(sys.executable).parent / "ptcluster"
    if not path.exists():
        pytest.skip(f"no installed console script at {path} (pip install -e . first)")
    return path


@pytest.fixture
def ptcluster_cmd():
    return [sys.executable, "-m", "ptcluster"]


@pytest.fixture(scope="session", autouse=True)
def _registry_of_heads(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every head a test starts registers in this session's registry (``control.registry``), not in
    the user's own ``~/.local/state``; a test may give a head or a `kill` another one."""
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))


@pytest.fixture
def no_leftovers():
    """Yields a list to append job ids to; fails if any of their processes survive."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        left = job_processes(job_id, wait=15.0)  # a failed test's teardown may be under way
        assert not left, f"job {job_id} left processes behind: {left}"


os.environ.setdefault("PYTHONUNBUFFERED", "1")
# Tests say which cluster they use; a CI runner that is itself a Slurm job must not turn every
# local-cluster test into one on its allocation (tests/support/slurmbed.py brings its own Slurm).
for _var in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
    os.environ.pop(_var, None)


_JOB_PROGRAMS = ("torch.distributed.run", "torchrun")


def _starts_a_job_or_testbed(argv: object) -> bool:
    """A real job (a guard, which starts torchrun; torchrun itself) or the namespace testbed."""
    from ptcluster.remote.bootstrap import BOOTSTRAP

    args = [str(a) for a in argv] if isinstance(argv, (list, tuple)) else [str(argv)]
    if BOOTSTRAP in args and args[args.index(BOOTSTRAP) + 1:][:1] == ["guard"]:
        return True
    if any(a in _JOB_PROGRAMS or a.endswith("/torchrun") for a in args):
        return True
    return args[:2] == ["ip", "netns"] or "sshd" in os.path.basename(args[0] if args else "")


@pytest.fixture(autouse=True)
def _fast_tests_start_no_job(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """``-m "not slow"`` is the quick inner loop: a test that starts a real job or the testbed
    must be marked ``slow`` (testbed tests are); ``no_job``: a guard that refuses before any
    job starts. Enforced, not hoped for."""
    if request.node.get_closest_marker("slow") or request.node.get_closest_marker("no_job"):
        yield
        return
    import subprocess

    real = subprocess.Popen.__init__

    def refuse(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
        if _starts_a_job_or_testbed(args):
            raise AssertionError(f"{request.node.nodeid} starts a job or the testbed "
                                 f"({args!r:.120}): mark it @pytest.mark.slow")
        real(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
