"""``run`` with an unchanged environment launches at once: no session asks the nodes first (the
head remembers each node's platform and digests, ``venvs.known``), the guard checks the
environment before any rank starts; when it is gone, the guard says so by name and the head ships
and builds it, then launches the same job. Through the real entry point, on the local cluster,
with a HOME of the test's own (the head's records and the node's environments both under it)."""

from __future__ import annotations

import io
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ptcluster.venvs import runenv
from ptcluster.venvs.runenv import GUARD, SHIP
from ptcluster.venvs.ship import BUILT, UP_TO_DATE
from tests.support.wheelmaker import make_wheel

pytestmark = pytest.mark.slow


class Project:
    """A project whose requirements.txt names a package nothing here has (its wheel in a
    folder: no index), a job that writes what each rank imported and from where, and a count
    of the ship sessions the head opened (the real ``ship``, counted)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch,
                 capfd: pytest.CaptureFixture[str], jobs: list[str]) -> None:
        self.root, self.capfd, self.home, self.jobs = root / "proj", capfd, root / "home", jobs
        self.out = root / "out"
        for d in (self.root / "wheels", self.home, self.out):
            d.mkdir(parents=True)
        make_wheel(self.root / "wheels", "tinypkg", "1.0")
        (self.root / "requirements.txt").write_text("tinypkg==1.0\n")
        (self.root / "train.py").write_text(
            "import os, sys, tinypkg\n"
            f"open(os.path.join({str(self.out)!r}, os.environ['RANK']), 'w').write("
            "tinypkg.VERSION + ' ' + sys.executable)\n")
        monkeypatch.setenv("HOME", str(self.home))
        monkeypatch.setenv("UV_CACHE_DIR", str(root / "uv-cache"))
        monkeypatch.setenv("UV_NO_CONFIG", "1")
        monkeypatch.chdir(self.root)
        self.ships = 0
        real: Callable[..., Any] = runenv.ship

        def counted(*args: Any, **kw: Any) -> Any:
            self.ships += 1
            return real(*args, **kw)
        monkeypatch.setattr(runenv, "ship", counted)
        monkeypatch.setattr(sys, "stdin", io.StringIO(""))

    def run(self) -> tuple[int, str, dict[str, Any]]:
        """One ``ptcluster run``: its exit code, stderr and summary.json."""
        from ptcluster.cli import main
        runs = self.root / "runs"
        before = set(runs.glob("2*")) if runs.exists() else set()
        self.capfd.readouterr()
        with pytest.raises(SystemExit) as exited:
            main(["run", "--nproc", "1", "--run-dir", str(runs), "--requirements",
                  "requirements.txt", "--find-links", "wheels", "train.py"])
        _, err = self.capfd.readouterr()
        (new,) = set(runs.glob("2*")) - before
        summary = json.loads((new / "summary.json").read_text())
        self.jobs.append(summary["job_id"])  # (no_leftovers: none of its processes remain)
        return exited.value.code or 0, err, summary

    def ranks_said(self) -> str:
        return (self.out / "0").read_text()


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            capfd: pytest.CaptureFixture[str], no_leftovers: list[str]) -> Project:
    return Project(tmp_path, monkeypatch, capfd, no_leftovers)


def node_of(summary: dict[str, Any]) -> dict[str, Any]:
    (node,) = summary["environment"]["nodes"].values()
    return node


def test_an_unchanged_environment_is_launched_without_asking(project: Project) -> None:
    code, err, summary = project.run()
    assert code == 0, err
    assert project.ships == 1 and node_of(summary)["checked_by"] == SHIP
    assert node_of(summary)["state"] == BUILT
    digest = summary["environment"]["digest"]
    python = str(project.home / ".ptcluster" / "envs" / digest / "bin" / "python")
    assert project.ranks_said() == f"1.0 {python}"

    (project.out / "0").unlink()
    code, err, summary = project.run()
    assert code == 0, err
    assert project.ships == 1  # no session asked the node anything before the launch
    assert node_of(summary) == {  # python: as its rank saw it, not ~/-relative
        "digest": digest, "state": UP_TO_DATE, "python": python, "checked_by": GUARD,
        "wheels_sent": 0, "bytes_sent": 0, "build_s": 0.0}
    assert summary["environment"]["python"] == {"0": python}
    assert project.ranks_said() == f"1.0 {python}"
    assert "sent" not in err and len(summary["attempts"]) == 1


def test_a_removed_environment_is_named_by_the_guard_then_shipped(project: Project) -> None:
    code, err, summary = project.run()
    assert code == 0, err
    digest = summary["environment"]["digest"]
    env_dir = project.home / ".ptcluster" / "envs" / digest
    shutil.rmtree(env_dir)  # (by hand, or a prune from another head)

    (project.out / "0").unlink()
    code, err, summary = project.run()
    assert code == 0, err
    assert summary["environment"]["reshipped"] == {"localhost": "guard.environment-not-ready"}
    assert project.ships == 2 and node_of(summary)["checked_by"] == SHIP
    assert node_of(summary)["state"] == BUILT and node_of(summary)["wheels_sent"] == 0
    assert project.ranks_said() == f"1.0 {env_dir / 'bin' / 'python'}"
    assert len(summary["attempts"]) == 1 and summary["failures"] == []

    code, err, summary = project.run()  # what the reship found is remembered: at once again
    assert code == 0, err
    assert project.ships == 2 and node_of(summary)["checked_by"] == GUARD


def test_a_node_whose_torch_changed_since_the_head_looked_is_shipped_and_checked_again(
        project: Project) -> None:
    """The head launches without asking when it remembers the node with this digest; it
    checked the lock's torch against the torch it remembers. When setup has changed the node's
    torch since (here: the record says another one), the guard says changed and the head ships,
    which checks the lock against the node's torch as it is now."""
    code, err, _ = project.run()
    assert code == 0, err
    (record,) = (project.home / ".cache" / "ptcluster" / "nodes").glob("*.json")
    remembered = json.loads(record.read_text())
    record.write_text(json.dumps({**remembered, "torch": "0.0.1"}))
    (project.out / "0").unlink()
    code, err, summary = project.run()
    assert code == 0, err
    assert summary["environment"]["reshipped"] == {"localhost": "guard.environment-not-ready"}
    assert project.ships == 2 and node_of(summary)["checked_by"] == SHIP
    assert json.loads(record.read_text())["torch"] == remembered["torch"]  # (as it is now)
