"""The project's environment (issue 42), its data (issue 44) and checkpoints with replicas inside
a real Slurm allocation (tests/support/slurmbed.py): ptcluster reaches every node through one
``srun`` step per node, and the wheels, the data files and the relay's traffic go through those
steps and the cluster network, as over ssh.

Each node gets disks of its own for what must never be shared by accident: a tmpfs over
``~/.ptcluster`` (where a node keeps its environments and the wheels it received) and over a
scratch folder (the data's and checkpoints' destination), mounted in the node's own mount
namespace, so the slurmd there and every step it starts see that node's copy alone. The rest
(the project, the venv with torch) is shared, as a cluster's home directories are.

One Slurm testbed for the module; every test cancels what it started and leaves no process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.wheels import make_wheel, uv_wheel

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
PY = sys.executable
NODE_HOME = Path.home() / ".ptcluster"
RANK = textwrap.dedent("""
    import hashlib, json, os, socket, sys
    import tinyslurm
    found = {}
    for key, folder in sorted(os.environ.items()):
        if key.startswith("PTCLUSTER_DATA"):
            found[key] = {os.path.relpath(os.path.join(top, name), folder):
                          hashlib.sha256(open(os.path.join(top, name), "rb").read()).hexdigest()
                          for top, _, names in os.walk(folder) for name in names
                          if not name.startswith(".")}
    print("RANKINFO " + json.dumps({"rank": int(os.environ["RANK"]),
          "host": socket.gethostname(), "tinyslurm": tinyslurm.VERSION,
          "module": tinyslurm.__file__, "python": sys.executable, "data": found}), flush=True)
""")


@pytest.fixture(scope="module")
def slurm() -> Iterator:
    from tests.support.slurmbed import SlurmBed, available
    from tests.support.testbed import bring_up

    if uv_wheel() is None:
        pytest.skip("no uv wheel at hand (PTC_UV_WHEEL): the head cannot resolve offline")
    bed = bring_up("Slurm testbed", available(), lambda: SlurmBed(3))
    try:
        bed.scratch = bed.dir / "scratch"
        bed.scratch.mkdir()
        NODE_HOME.mkdir(exist_ok=True)
        for node in bed.nodes:
            for folder in (NODE_HOME, bed.scratch):
                subprocess.run(["nsenter", "-t", node.sshd_pidfile.read_text().strip(), "-m",
                                "--", "mount", "-t", "tmpfs", "-o", "size=512m,mode=0700",
                                f"ptc{bed.bed.id}", str(folder)], check=True, timeout=10)
        yield bed
    finally:
        bed.close()  # the mounts end with the nodes' mount namespaces


@pytest.fixture
def clean(slurm):
    """After each test: no job, no step, nothing of a job on any node."""
    yield slurm
    left = slurm.wait_no_jobs(timeout=30)
    slurm.cancel_all()
    deadline = time.monotonic() + 15
    while (procs := slurm.node_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"Slurm jobs left: {left}"
    assert not procs, f"processes left on the nodes: {procs}"


def client(slurm, *argv: str, cwd: Path, timeout: float = 240,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A command against this Slurm (salloc, submit, ...), run in ``cwd``."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**slurm.env, **(env or {})})


def in_node(slurm, node, script: str) -> str:
    """``script`` run in ``node``'s mount namespace: what that node's own disks hold."""
    out = subprocess.run(["nsenter", "-t", node.sshd_pidfile.read_text().strip(), "-m", "--",
                          "sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def project(tmp_path: Path, version: str = "1.2.3") -> dict[str, Path]:
    """A wheel made here (no index anywhere), a requirements file naming it, a data set."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "tinyslurm", version)
    (tmp_path / "requirements.txt").write_text(f"tinyslurm=={version}\n")
    data = tmp_path / "dset"
    (data / "sub").mkdir(parents=True)
    (data / "a.bin").write_bytes(os.urandom(300_000))
    (data / "sub" / "b.txt").write_text("b\n" * 1000)
    (tmp_path / "rank.py").write_text(RANK)
    return {"wheels": wheels, "data": data}


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def rank_infos(text: str) -> dict[int, dict]:
    infos = [json.loads(m.group(1)) for m in re.finditer(r"RANKINFO (\{.*\})", text)]
    return {info["rank"]: info for info in infos}


def check_nodes(slurm, infos: dict[int, dict], dest: str, data: Path) -> None:
    """Every rank imported the wheel from its node's environment and saw the data's folder
    as PTCLUSTER_DATA_DSET with the head's bytes; each node's own disk holds both."""
    assert sorted(infos) == [0, 1, 2], infos
    assert {i["host"] for i in infos.values()} == {n.name for n in slurm.nodes}
    top = digests(data)
    for info in infos.values():
        assert info["tinyslurm"] == "1.2.3", info
        env = Path(info["python"]).parent.parent
        assert env.parent == NODE_HOME / "envs", info
        assert info["module"].startswith(str(env)), info
        assert info["data"] == {"PTCLUSTER_DATA": top, "PTCLUSTER_DATA_DSET": top}, info
    for node in slurm.nodes:
        listed = in_node(slurm, node, f"ls {NODE_HOME}/envs; cd {dest} && sha256sum a.bin "
                                      "sub/b.txt")
        assert Path(infos[0]["python"]).parent.parent.name in listed, (node.name, listed)
        for name, sha in digests(data).items():
            assert f"{sha}  {name}" in listed, (node.name, listed)


def test_submit_builds_the_cluster_files_environment_and_pushes_its_data_on_every_node(
        clean, tmp_path) -> None:
    """`ptcluster submit` of a project whose ./cluster.yaml has `requirements:`,
    `find_links:` and `data:` (no nodes: they are Slurm's), vouched for by its path: inside the
    job, run resolves the wheel offline, ships it to every node over its srun step, each node
    builds the environment on its own disk, the data goes to every node's scratch, and every
    rank imports the wheel and reads the data by PTCLUSTER_DATA_DSET."""
    slurm = clean
    made = project(tmp_path)
    dest = f"{slurm.scratch}/dset"
    # a requirements file that names where to find wheels needs the file's trust, vouched for
    # by its path (sbatch passes the variable on to the job)
    (tmp_path / "requirements.txt").write_text("-f wheels\ntinyslurm==1.2.3\n")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"requirements: requirements.txt\nfind_links: [wheels]\n"
                       f"data:\n  - {{name: dset, src: dset, dest: {dest}}}\n")
    res = client(slurm, PY, "-m", "ptcluster", "submit", "--nodes", "3", "--nproc", "1",
                    "--run-dir", str(tmp_path / "runs"), "--", "rank.py",
                    env={"PTCLUSTER_TRUST_CLUSTER_FILE": str(cluster)}, cwd=tmp_path)
    job = res.stdout.strip()
    assert job.isdigit(), res
    assert not slurm.wait_no_jobs(timeout=240)
    (log,) = (tmp_path / "runs").glob(f"*/slurm-{job}.out")
    text = log.read_text()
    assert "requirements:, find_links:, data: from the cluster file cluster.yaml" in text, text
    assert text.count("environment built") == 3, text
    check_nodes(slurm, rank_infos(text), dest, made["data"])


def test_run_in_salloc_with_flags_then_unchanged_then_push_sends_one_changed_file(
        clean, tmp_path) -> None:
    """`salloc ptcluster run --requirements --find-links --data`: built and pushed on every
    node; a second run launches at once (the guards check the environments, nothing is
    shipped, no data byte sent); `ptcluster push` inside an allocation then sends only the
    file that changed, relayed from node to node."""
    slurm = clean
    made = project(tmp_path)
    dest = f"{slurm.scratch}/flags"
    run = ["salloc", "-N3", PY, "-m", "ptcluster", "run", "--run-dir", str(tmp_path / "runs"),
           "--requirements", "requirements.txt", "--find-links", str(made["wheels"]),
           "--data", f"{made['data']}={dest}", "rank.py"]
    first = client(slurm, *run, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    check_nodes(slurm, rank_infos(first.stdout), dest, made["data"])
    again = client(slurm, *run, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "wheels" not in again.stderr and "sent" not in again.stderr, again.stderr
    check_nodes(slurm, rank_infos(again.stdout), dest, made["data"])
    (made["data"] / "sub" / "b.txt").write_text("changed\n")
    push = client(slurm, "salloc", "-N3", PY, "-m", "ptcluster", "push", str(made["data"]),
                  "--to", dest, "--json", cwd=tmp_path)
    assert push.returncode == 0, push.stderr[-4000:]
    said = json.loads(push.stdout)
    # the one changed file's 8 bytes, to every node, relayed from node to node
    assert (said["ok"], said["bytes_sent"], len(said["nodes"])) == (True, 8, 3), said
    assert sorted(said["chain"]) == sorted(n["host"] for n in said["nodes"]), said
    sha = hashlib.sha256(b"changed\n").hexdigest()
    for node in slurm.nodes:
        assert f"{sha}  sub/b.txt" in in_node(slurm, node, f"cd {dest} && sha256sum sub/b.txt")


def test_checkpoint_replicas_on_each_nodes_own_disk_and_a_resume(clean, tmp_path) -> None:
    """`ptcluster.checkpoint` in a job inside an allocation, its folder on each node's own
    scratch: every node holds its part and the replica of the node before it in the ring, the
    step's marker is written, and a second run loads that step."""
    from tests.support.ckptjob import PROGRAM

    slurm = clean
    ckpt = f"{slurm.scratch}/ckpt"
    run = ["salloc", "-N3", PY, "-m", "ptcluster", "run", "--run-dir", str(tmp_path / "runs"),
           str(PROGRAM), "--steps", "4", "--every", "2", "--dir", ckpt]
    first = client(slurm, *run, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-4000:] + first.stdout[-4000:]
    for i, node in enumerate(slurm.nodes):
        listed = in_node(slurm, node, f"cd {ckpt}/step-4 && ls -a . replica-of-{(i - 1) % 3}")
        assert "COMPLETE" in listed and ".distcp" in listed.split("replica-of")[-1], \
            (node.name, listed)
    again = client(slurm, *run, "--resume", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "loaded 4" in again.stdout, again.stdout[-3000:]
