"""The declared environment through the CLI: the key and the flags, ``env``'s interpreter and
digest (no node asked), ``init``'s key, and bad input refused with exit 2 before any node is
touched. Wheels are made here; nothing is downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from ptcluster.cluster import load_cluster_file
from ptcluster.venvs.platforms import head_platform
from ptcluster.venvs.resolve import resolve
from ptcluster.venvs.store import WheelStore
from tests.support import wheelmaker
from tests.support.wheelmaker import make_wheel

uv_folder = wheelmaker.uv_folder  # the fixture

MP = pytest.MonkeyPatch
UNREACHABLE = "nodes: [{host: node-that-is-not-there.invalid, slots: 1}]\n"


@pytest.fixture
def project(tmp_path: Path, uv_folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder with a cluster file naming its requirements and a folder of wheels;
    the home (the head's wheel store) is the test's own."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setenv("UV_NO_CONFIG", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PTCLUSTER_TRUST_CLUSTER_FILE", raising=False)
    proj = tmp_path / "proj"
    wheels = proj / "wheels"
    make_wheel(wheels, "alpha", "1.0", requires=["beta"])
    make_wheel(wheels, "beta", "2.0")
    for wheel in uv_folder.iterdir():
        os.link(wheel, wheels / wheel.name)
    (proj / "requirements.txt").write_text("alpha\n")
    (proj / "requirements-beta.txt").write_text("beta\n")
    (proj / "cluster.yaml").write_text(UNREACHABLE + "requirements: requirements.txt\n"
                                       "find_links: [wheels]\n")
    return proj


def test_env_prints_the_ranks_interpreter_and_digest_from_the_key(cli, monkeypatch: MP,
                                                                   project: Path,
                                                                   tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # the key is relative to the cluster file's folder, not the cwd
    code, out, err = cli("env", "--cluster", str(project / "cluster.yaml"), "--json")
    assert code == 0, err
    said = json.loads(out)[0]["environment"]
    expected = resolve(project / "requirements.txt", head_platform(),
                       find_links=[project / "wheels"], refresh=False,
                       store=WheelStore(tmp_path / "home/.cache/ptcluster/wheels"),
                       trusted=False)
    assert said["digest"] == expected.digest and said["wheels"] == 2
    assert said["python"] == f"~/.ptcluster/envs/{expected.digest}/bin/python"
    code, text, _ = cli("env", "--cluster", str(project / "cluster.yaml"))
    assert f"# python: ~/.ptcluster/envs/{expected.digest}/bin/python" in text


def test_the_flag_wins_over_the_key_relative_to_the_cwd(cli, monkeypatch: MP,
                                                        project: Path) -> None:
    monkeypatch.chdir(project)
    _, by_key, _ = cli("env", "--json")
    code, by_flag, err = cli("env", "--json", "--requirements", "requirements-beta.txt")
    assert code == 0, err
    key_env, flag_env = (json.loads(o)[0]["environment"] for o in (by_key, by_flag))
    assert flag_env["source"] == "requirements-beta.txt" and flag_env["wheels"] == 1
    assert flag_env["digest"] != key_env["digest"]


@pytest.mark.parametrize(("args", "file", "said"), [
    (["--requirements", "Pipfile"], "Pipfile",
     ("venvs.not-a-requirements-file", {"path": "Pipfile"})),
    (["--requirements", "missing/requirements.txt"], None,
     ("venvs.requirements-missing", {"path": "missing/requirements.txt"})),
    (["--requirements", "requirements.txt"], "requirements.txt",
     ("venvs.index-untrusted", {"source": "requirements.txt",
                                "elsewhere": "--extra-index-url https://mirror.invalid/simple "
                                             "(requirements.txt:1)"})),
    (["--requirements", "requirements.txt", "--find-links", "no-such-dir"], None,
     ("venvs.not-a-folder", {"folder": "no-such-dir"})),
])
@pytest.mark.parametrize("command", ["run", "doctor", "env"])
def test_bad_input_is_exit_2_before_any_node(cli, monkeypatch: MP, project: Path,
                                             command: str, args: list[str], file: str | None,
                                             said: tuple[str, dict[str, str]]) -> None:
    monkeypatch.chdir(project)
    if file == "requirements.txt":
        (project / file).write_text("--extra-index-url https://mirror.invalid/simple\nalpha\n")
    elif file:
        (project / file).write_text("x\n")
    argv = [command, *args] + (["train.py"] if command == "run" else [])
    code, out, err = cli(*argv)
    assert code == 2, (out, err)
    assert (cli.problem.code, cli.problem.fields) == said, err
    assert str(cli.problem) in err and "Traceback" not in err  # (said as one line)
    assert "node-that-is-not-there" not in err  # refused before any node was tried


def test_trusted_file_may_name_another_index(cli, monkeypatch: MP, project: Path) -> None:
    monkeypatch.chdir(project)
    (project / "requirements.txt").write_text("-f wheels\nalpha\n")
    code, out, err = cli("env", "--trust-cluster-file", "--json")
    assert code == 0, err
    assert json.loads(out)[0]["environment"]["wheels"] == 2


def test_find_links_without_requirements_is_refused(cli, monkeypatch: MP,
                                                    tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster.yaml").write_text(UNREACHABLE)
    code, _, err = cli("env", "--find-links", str(tmp_path))
    assert code == 2 and cli.problem.code == "venvs.nothing-declared", err
    assert cli.problem.fields == {"flag": "--find-links"}


def test_init_writes_the_key_for_the_projects_file(cli, monkeypatch: MP, project: Path) -> None:
    monkeypatch.chdir(project)
    (project / "uv.lock").write_text("version = 1\n")
    (project / "conf").mkdir()
    code, _, err = cli("init", "--hosts", "a:1", "-o", "conf/cluster.yaml")
    assert code == 0, err
    written = yaml.safe_load((project / "conf/cluster.yaml").read_text())
    assert written["requirements"] == "../uv.lock"  # relative to the cluster file
    spec = load_cluster_file(project / "conf/cluster.yaml")
    assert spec.requirements is not None
    assert Path(spec.requirements).resolve() == (project / "uv.lock").resolve()
    (project / "uv.lock").unlink()
    for name in ("requirements.txt", "requirements-beta.txt"):
        (project / name).unlink()
    code, out, _ = cli("init", "--hosts", "a:1", "-o", "-")
    assert "# requirements: requirements.txt" in out and "\nrequirements:" not in out
