"""A cluster file found in the current directory (a cloned repository's) runs nothing on this
machine: every command that reads one says which it uses and refuses ssh settings that are code
unless the user vouches for the file (SECURITY-REVIEW findings 11 and 14). Real commands, real
ssh: on the old code the ProxyCommand ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ptcluster.cluster.load import load_cluster_file
from ptcluster.errors import SpecError

TRUST = "PTCLUSTER_TRUST_CLUSTER_FILE"
COMMANDS = [("env",), ("doctor", "--skip-allreduce"), ("ps",), ("monitor", "--once"),
            ("bench",), ("sync",), ("setup",), ("kill", "no-such-job-5c1e"), ("run", "t.py")]


def _ptc(*args: str, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in (TRUST, "PTCLUSTER_CLUSTER")}
    base.update({"XDG_STATE_HOME": str(cwd / "state"), **(env or {})})
    for key in [k for k in base if k.startswith("SLURM_")]:
        del base[key]
    return subprocess.run([sys.executable, "-m", "ptcluster", *args], cwd=cwd, env=base,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _repo(tmp_path: Path) -> tuple[Path, Path]:
    """A 'cloned repository': a cluster.yaml whose ProxyCommand would leave a marker."""
    marker = tmp_path / "owned"
    repo = tmp_path / "repo"
    repo.mkdir(parents=True)
    (repo / "t.py").write_text("print('hi')\n")
    (repo / "cluster.yaml").write_text(
        "nodes: [{host: 127.0.0.1, slots: 1}]\n"
        f"ssh: {{options: {{ProxyCommand: \"sh -c 'touch {marker}; exit 1'\", "
        "ConnectTimeout: 3}}\n")
    return repo, marker


ANNOUNCED = "ptcluster: using the cluster file cluster.yaml (from the current directory)"
"""The note of a cluster file found, not given (``--cluster``): one line, as it is."""


def _refused(repo: Path, monkeypatch: pytest.MonkeyPatch) -> SpecError:
    """The loader's refusal of the repository's file, untrusted: what every command says."""
    monkeypatch.chdir(repo)  # (a command in the repository names it as found there)
    with pytest.raises(SpecError) as refused:
        load_cluster_file("cluster.yaml")
    return refused.value


@pytest.mark.parametrize("args", COMMANDS, ids=[a[0] for a in COMMANDS])
def test_a_cluster_file_in_the_current_directory_runs_nothing(tmp_path, args,
                                                              monkeypatch) -> None:
    repo, marker = _repo(tmp_path)
    done = _ptc(*args, cwd=repo)
    assert not marker.exists(), f"{args}: the cluster file's ProxyCommand ran\n{done.stderr}"
    assert done.returncode == 2, done.stdout + done.stderr
    refused = _refused(repo, monkeypatch)
    assert (refused.source, refused.path) == ("cluster.yaml", "ssh.options.ProxyCommand")
    assert done.stderr.splitlines()[:2] == [ANNOUNCED, f"error: {refused}"], done.stderr
    # every command takes the flag: the file is then used as written (env connects nowhere)
    done = _ptc(args[0], "--trust-cluster-file", *args[1:], cwd=repo)
    assert marker.exists() == (args[0] != "env"), done.stdout + done.stderr


def test_a_trusted_cluster_file_is_used_as_written(tmp_path) -> None:
    """The flag (or the variable) says the file is the user's: then its ProxyCommand is
    theirs to run; ``--cluster`` given on the command line is not announced."""
    repo, marker = _repo(tmp_path)
    done = _ptc("ps", "--trust-cluster-file", cwd=repo)
    assert marker.exists(), done.stdout + done.stderr
    marker.unlink()
    done = _ptc("doctor", "--cluster", "cluster.yaml", "--skip-allreduce", cwd=repo,
                env={TRUST: "1"})
    assert marker.exists(), done.stdout + done.stderr
    assert ANNOUNCED not in done.stderr.splitlines()
    done = _ptc("env", cwd=tmp_path, env={"PTCLUSTER_CLUSTER": str(repo / "cluster.yaml"),
                                          TRUST: "1"})
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0] == (f"ptcluster: using the cluster file "
                                           f"{repo / 'cluster.yaml'} (from $PTCLUSTER_CLUSTER)")
    done = _ptc("-q", "env", cwd=repo, env={TRUST: "1"})
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_the_variable_naming_one_file_trusts_that_file_alone(tmp_path) -> None:
    """``PTCLUSTER_TRUST_CLUSTER_FILE=/path/cluster.yaml`` (what the docs export, L7): that
    file is trusted; a cloned repository's ``cluster.yaml`` in another folder is not."""
    mine, marker = _repo(tmp_path / "mine")
    cloned, other = _repo(tmp_path / "cloned")
    done = _ptc("ps", cwd=mine, env={TRUST: str(mine / "cluster.yaml")})
    assert marker.exists(), done.stdout + done.stderr
    done = _ptc("ps", cwd=cloned, env={TRUST: str(mine / "cluster.yaml")})
    assert not other.exists() and done.returncode == 2, done.stdout + done.stderr
    assert "--trust-cluster-file" in done.stderr


def test_env_output_is_safe_to_eval(tmp_path) -> None:
    """``eval "$(ptcluster env)"``: a host with a command in its IPv6 scope id is refused (it
    was echoed into a comment, and a line break ended the comment); values reach the shell
    quoted."""
    marker = tmp_path / "owned"
    script = ('eval "$("$0" -m ptcluster env --cluster "$1")" || exit 9; '
              'printf %s "$ODD" > "$2"')
    out = tmp_path / "odd"
    clusters = ['nodes: ["fe80::1%x\\ntouch owned;#"]\n',  # (no '/': ipaddress refuses it)
                'nodes: ["fe80::1%$(touch owned)"]\n', 'nodes: ["fe80::1%x;touch owned"]\n',
                "nodes: ['[fe80::1%lo]:2']\n"
                "env: {ODD: \"a'b $(touch owned) `id` \\n c \\e[2J\\\\\"}\n"]
    for text in clusters:
        cluster = tmp_path / "c.yaml"
        cluster.write_text(text)
        subprocess.run(["bash", "-c", script, sys.executable, str(cluster), str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert not marker.exists(), text
    assert out.read_text() == "a'b $(touch owned) `id` \n c \x1b[2J\\"
    shown = _ptc("env", "--cluster", str(cluster), cwd=tmp_path)
    assert shown.returncode == 0 and "\x1b" not in shown.stdout, shown.stdout  # ($'\x1b')


PLANTED = ("json", "socket", "argparse", "datetime", "runpy", "zlib", "base64")
"""Modules ptcluster's rank programs, the shim and torchrun's agent import after they start."""


@pytest.mark.slow
def test_doctors_ranks_and_torchruns_agent_import_nothing_from_the_repository(
        tmp_path, console_script: Path) -> None:
    """M3: ``ptcluster doctor`` typed in a cloned repository (the local cluster: its ranks
    start in the current directory). The repository's ``argparse.py``, ``json.py`` … and
    ``torch/`` would each leave a marker when imported; none is imported, and the all-reduce
    passes. On e44ddf7 torchrun's agent imported ``argparse.py`` and the all-reduce failed."""
    repo = tmp_path / "repo"
    (repo / "torch").mkdir(parents=True)
    plant = "import os\nopen(os.path.join({where!r}, {name!r} + '.ran'), 'w').close()\n"
    for name in PLANTED:
        (repo / f"{name}.py").write_text(plant.format(where=str(tmp_path), name=name))
    (repo / "torch" / "__init__.py").write_text(plant.format(where=str(tmp_path),
                                                             name="torch"))
    env = {k: v for k, v in os.environ.items()
           if k not in (TRUST, "PTCLUSTER_CLUSTER", "PYTHONPATH") and not k.startswith("SLURM_")}
    done = subprocess.run([str(console_script), "doctor", "--nproc", "2", "--json"], cwd=repo,
                          env={**env, "XDG_STATE_HOME": str(tmp_path / "state")},
                          capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)
    assert sorted(p.name for p in tmp_path.glob("*.ran")) == [], done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert allreduce_verified(done.stdout, 2)


@pytest.mark.slow
def test_the_users_own_program_still_imports_as_python_would(tmp_path,
                                                             console_script: Path) -> None:
    """The other side of M3: ``run -m MOD`` finds modules in the current directory and ``run
    DIR/SCRIPT`` in the script's own, as ``python`` gives them (the shim puts them back)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "mymod.py").write_text("import helper\nprint('MOD', helper.X)\n")
    (tmp_path / "helper.py").write_text("X = 'cwd-helper'\n")
    (tmp_path / "sub" / "script.py").write_text("import sibling\nprint('SCRIPT', sibling.Y)\n")
    (tmp_path / "sub" / "sibling.py").write_text("Y = 'script-dir'\n")
    env = {k: v for k, v in os.environ.items()
           if k not in (TRUST, "PTCLUSTER_CLUSTER") and not k.startswith("SLURM_")}
    for target, said in ((["-m", "mymod"], "MOD cwd-helper"),
                         (["sub/script.py"], "SCRIPT script-dir")):
        done = subprocess.run([str(console_script), "run", "--nproc", "1", "--run-dir",
                               str(tmp_path / "runs"), *target], cwd=tmp_path,
                              env={**env, "XDG_STATE_HOME": str(tmp_path / "state")},
                              capture_output=True, text=True, timeout=240,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 0 and f"[localhost:0] {said}" in done.stdout, \
            done.stdout + done.stderr


@pytest.mark.slow
def test_doctors_ranks_start_in_a_private_directory(tmp_path, console_script: Path) -> None:
    """M3's last part: the all-reduce's ranks start in a private temporary directory, not the
    current one, so a module planted there is not found even where '.' or '' stays on sys.path
    (here: ``PYTHONPATH=.``, which Python keeps as given, and a ``sitecustomize.py`` that the
    ranks' interpreters import at start). On 2094e8b the ranks imported it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "sitecustomize.py").write_text(
        "import os\nif 'RANK' in os.environ:\n"
        f"    open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK'] + '.ran'), "
        "'w').write(os.getcwd())\n")
    env = {k: v for k, v in os.environ.items()
           if k not in (TRUST, "PTCLUSTER_CLUSTER") and not k.startswith("SLURM_")}
    done = subprocess.run([str(console_script), "doctor", "--nproc", "2", "--json"], cwd=repo,
                          env={**env, "XDG_STATE_HOME": str(tmp_path / "state"),
                               "PYTHONPATH": "."},
                          capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)
    assert sorted(p.name for p in tmp_path.glob("*.ran")) == [], done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert allreduce_verified(done.stdout, 2)


def allreduce_verified(doctor_json: str, ranks: int) -> bool:
    """``doctor --json`` says the all-reduce ran on ``ranks`` ranks over gloo and its result
    was right (its finding ok, no element wrong)."""
    report = json.loads(doctor_json)
    said = report["allreduce"]
    found = [f["status"] for f in report["findings"] if f["check"] == "all-reduce"]
    return (said["world_size"], said["backend"], said["wrong"], found) == (
        ranks, "gloo", 0, ["ok"])
