"""``ptcluster setup --slurm`` on systemd-nspawn nodes (``support/nspawn.py``): machines with
systemd as init, their own dpkg database and no network but the bed's bridge; munge, slurmctld
and slurmd run under ``systemctl`` there, installed by setup from each node's own apt source.

The tests run in file order and build on each other: a dry run shows the files, setup from
nothing ends with every node idle and a job through Slurm, the munge key is one and nowhere in
sight, a second run changes nothing, ``--check`` holds, the reference trainer runs through
``ptcluster submit`` on all three nodes, a fourth node joins.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support import bare
from tests.support import nspawn as ns
from tests.support.testbed import bring_up

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
FIGURES: dict[str, float | str] = {}
"""What the tests measured (printed at the end of the module, ``-s`` shows it)."""


@pytest.fixture(scope="module")
def bed():
    def make() -> ns.NspawnBed:
        from tests.support.testbed import TestbedError

        try:
            return ns.NspawnBed(3)
        except ns.NspawnError as exc:
            raise TestbedError(str(exc)) from None

    b = bring_up("nspawn testbed", ns.available(), make)
    try:  # s13n2's admin turned ufw on (default deny incoming, ssh allowed)
        b.sh(b.nodes[2], "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install "
             "-y -q ufw && ufw allow 22/tcp && ufw --force enable", timeout=120)
        for node in b.nodes:
            put_data(b, node)
    except BaseException:
        b.close()
        raise
    key, _ = _head_key(b)
    key.unlink(missing_ok=True)  # from nothing: the head makes the cluster's key
    try:
        yield b
    finally:
        b.close()
        key.unlink(missing_ok=True)
        for name, value in FIGURES.items():
            print(f"FIGURE {name}: {value}", file=sys.stderr)


def put_data(b: ns.NspawnBed, node: ns.Node) -> None:
    """The data set in the workdir's ``data/`` (where the trainer looks by default): the nodes
    have no network to download MNIST."""
    folder = Path(b.dir) / "mnist"
    if not folder.exists():
        _idx_files(folder)
    tar = subprocess.run(["tar", "-C", str(folder), "-cf", "-", "."], capture_output=True,
                         timeout=30, check=True)
    subprocess.run(b.ssh(node, "mkdir -p /root/proj/data && tar -C /root/proj/data -xf -"),
                   input=tar.stdout, check=True, timeout=30)


def _head_key(b: ns.NspawnBed) -> tuple[Path, None]:
    from ptcluster.setup.slurm import SLURM_DIR

    return Path(SLURM_DIR).expanduser() / f"munge-{b.nodes[0].name}.key", None


@pytest.fixture(scope="module")
def work(bed: ns.NspawnBed, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("slurm-setup")

    def cluster(n: int, name: str) -> Path:
        path = root / name
        path.write_text(bed.cluster_yaml(bed.nodes[:n], extra="workdir: /root/proj\n"
                                         "master: {port: 29541}\nslurm: {}\n"))
        return path

    return {"root": root, "cluster": cluster(3, "c3.yaml"), "wheelhouse": root / "wheelhouse",
            "cluster4": root / "c4.yaml", "make4": cluster}  # type: ignore[dict-item]


def ptc(work: dict[str, Path], *args: str, timeout: float = 1200,
        cluster: str = "cluster") -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(bare.WHEELS))
    begun = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ptcluster", "setup", "--cluster",
                           str(work[cluster]), "--wheelhouse", str(work["wheelhouse"]), *args],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - begun


class ArgvWatch:
    """Every process's argv on this machine (the nodes' processes included: nspawn shares the
    kernel), looked at while setup runs, for the munge key."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            self.seen.add(f.read())
                    except OSError:
                        pass
            time.sleep(0.05)

    def stop(self) -> set[bytes]:
        self._stop.set()
        self._thread.join()
        return self.seen


OUTPUTS: list[str] = []
"""Every setup output of this module (stdout and stderr), searched for the key at the end."""


def test_dry_run_shows_the_files_and_changes_nothing(bed, work) -> None:
    proc, _ = ptc(work, "--dry-run")
    OUTPUTS.extend([proc.stdout, proc.stderr])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout  # (the rendering: the files themselves, shown)
    assert "| NodeName=s13n2 NodeAddr=10.233.0.12 CPUs=" in out
    said, _ = ptc(work, "--dry-run", "--json")
    OUTPUTS.extend([said.stdout, said.stderr])
    assert said.returncode == 0, said.stdout + said.stderr
    plans = {n["host"]: {s["step"]: s for s in n["plan"]} for n in json.loads(said.stdout)["nodes"]}
    ctl, n2 = plans[bed.nodes[0].name], plans[bed.nodes[2].name]
    assert (ctl["slurm packages"]["code"], ctl["slurm packages"]["fields"]) == (
        "setup.slurm-packages-missing", {"missing": "munge, slurmd, slurm-client, slurmctld"})
    conf = ctl["slurm.conf"]  # this host: cgroup v1, so Linux's /proc plugins
    assert conf["code"] == "setup.slurm-files", conf
    assert conf["fields"]["plugins"].startswith("proctrack/linuxproc, task/none: "), conf
    assert "ProctrackType=proctrack/linuxproc" in conf["files"][0].splitlines()
    assert (n2["firewall"]["code"], n2["firewall"]["fields"]) == (
        "setup.firewall-closed", {"kind": "ufw", "lacking": "10.233.0.10, 10.233.0.11"})
    assert not _head_key(bed)[0].exists(), "a dry run made the key"
    assert bed.sh(bed.nodes[0], "test ! -e /etc/slurm/slurm.conf", check=False).returncode == 0


def test_setup_from_nothing_ends_with_a_job_on_every_node(bed, work) -> None:
    watch = ArgvWatch()
    proc, took = ptc(work, "--json")
    argvs = watch.stop()
    OUTPUTS.extend([proc.stdout, proc.stderr])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    FIGURES["setup of 3 nodes from nothing (s)"] = round(took, 1)
    said = report["slurm"]
    assert said["ok"], said
    assert said["ran_on"] == ["s13n0", "s13n1", "s13n2"] and said["job_id"]
    FIGURES["setup's job"] = f"job {said['job_id']} on {said['ran_on']}"
    FIGURES["setup's sinfo"] = said["sinfo"]
    sinfo = bed.sh(bed.nodes[1], "sinfo -h -N -o '%N %t %c %m'").stdout
    FIGURES["sinfo after setup"] = sinfo.strip().replace("\n", " | ")
    assert [line.split()[1] for line in sinfo.splitlines()] == ["idle"] * 3, sinfo
    key = _head_key(bed)[0].read_bytes()
    for needle in (key, base64.b64encode(key), hashlib.sha256(key).hexdigest().encode()[:0]):
        if needle:
            assert not any(needle in a for a in argvs), "the munge key was in an argv"
    work["key"] = _head_key(bed)[0]
    work["report"] = report  # type: ignore[assignment]


def test_slurmd_behind_ufw_is_open_to_the_nodes_only(bed, work) -> None:
    """s13n2's ufw lets the other nodes in (setup's firewall step: TCP from each node), so
    slurmctld and srun reach its slurmd; this machine, the head but not a node, stays out."""
    n2 = bed.nodes[2].addr
    probe = f"timeout 3 bash -c 'echo > /dev/tcp/{n2}/6818'"
    assert bed.sh(bed.nodes[0], probe, check=False).returncode == 0
    proc = subprocess.run(["bash", "-c", probe], capture_output=True, timeout=10)
    assert proc.returncode == 124, proc  # dropped: a time-out, not a refusal


def test_one_munge_key_everywhere_0400_munge_and_nowhere_else(bed, work) -> None:
    key = work["key"].read_bytes()
    digest = hashlib.sha256(key).hexdigest()
    for node in bed.nodes:
        said = bed.sh(node, "stat -c '%U %a' /etc/munge/munge.key; "
                      "sha256sum /etc/munge/munge.key").stdout.split()
        assert said[:3] == ["munge", "400", digest], (node.name, said)
    assert oct(work["key"].stat().st_mode & 0o777) == "0o600"
    b64 = base64.b64encode(key).decode()
    for text in OUTPUTS:
        assert b64 not in text and key.hex() not in text
    # nothing the nodes logged (journal, Slurm's and munge's logs, the console) holds it
    for node in bed.nodes:
        logs = bed.sh(node, "journalctl --no-pager -o cat 2>/dev/null; "
                      "cat /var/log/slurm/* /var/log/munge/* 2>/dev/null", timeout=60).stdout
        assert b64 not in logs and key.hex() not in logs
        assert b64 not in (node.dir / "console.log").read_text(errors="replace")
    # a munge credential made on one node is accepted on another
    cred = bed.sh(bed.nodes[2], "munge -n").stdout
    proc = subprocess.run(bed.ssh(bed.nodes[0], "unmunge"), input=cred, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # (unmunge: 0 when it is accepted)


def test_second_run_changes_nothing_and_check_holds(bed, work) -> None:
    before = {n.name: bed.sh(n, "cat /etc/slurm/slurm.conf; systemctl show -p "
                             "ActiveEnterTimestamp slurmd munge").stdout for n in bed.nodes}
    proc, took = ptc(work, "--json", "--slurm-proof", "srun")
    OUTPUTS.extend([proc.stdout, proc.stderr])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    FIGURES["no-op re-run, --slurm-proof srun (s)"] = round(took, 1)
    changed = [(n["host"], a["step"]) for n in report["nodes"] for a in n["applied"]
               if a["result"] != "skipped"]
    assert changed == [], changed
    assert report["slurm"]["ok"]
    after = {n.name: bed.sh(n, "cat /etc/slurm/slurm.conf; systemctl show -p "
                            "ActiveEnterTimestamp slurmd munge").stdout for n in bed.nodes}
    assert after == before  # no file written, no daemon restarted
    proc, took = ptc(work, "--check")
    OUTPUTS.extend([proc.stdout, proc.stderr])
    assert proc.returncode == 0, proc.stdout[-3000:]
    FIGURES["--check (s)"] = round(took, 1)


def _idx_files(folder: Path) -> None:
    """The four MNIST files (IDX, gzipped), made from scikit-learn's bundled 8x8 digits scaled
    to 28x28: the nodes have no network, and MNIST's own files are not on this machine."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images * 15.9).astype(np.uint8).repeat(3, 1).repeat(3, 2)
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    labels = digits.target.astype(np.uint8)
    split = 1500
    folder.mkdir(parents=True, exist_ok=True)
    for kind, (imgs, labs) in {"train": (images[:split], labels[:split]),
                               "t10k": (images[split:], labels[split:])}.items():
        head = np.array([2051, len(imgs), 28, 28], dtype=">u4").tobytes()
        (folder / f"{kind}-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(head + imgs.tobytes()))
        head = np.array([2049, len(labs)], dtype=">u4").tobytes()
        (folder / f"{kind}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(head + labs.tobytes()))


def test_setups_proof_ran_the_reference_trainer_on_all_nodes(bed, work) -> None:
    """The report of setup from nothing: the reference trainer through ``ptcluster submit``,
    one epoch on the 3 nodes, completed; its run's summary.json says so (the proof reads no
    line the trainer prints), and its log (on the controller) too."""
    trainer = work["report"]["slurm"]["trainer"]  # type: ignore[index]
    assert trainer["ok"] and trainer["state"] == "COMPLETED", trainer
    assert trainer["outcome"] == "succeeded" and trainer["world_size"] == 3, trainer
    assert len(trainer["nodes"]) == 3, trainer
    log = bed.sh(bed.nodes[0], f"cat {trainer['log']}").stdout
    assert f"ptcluster submit: job {trainer['job_id']}" in log
    said = [line.strip() for line in log.splitlines() if "dataset=" in line][:1]
    FIGURES["trainer"] = f"job {trainer['job_id']} {trainer['state']}: " + " | ".join(
        said + [trainer["final"]])
    assert "dataset=mnist" in said[0] and "world_size=3" in said[0], log[-2000:]


def test_doctor_inside_an_allocation_takes_its_nodes_from_slurm(bed, work) -> None:
    """The rest of ptcluster uses the new cluster: doctor in an allocation of all 3 nodes
    checks those nodes (srun steps) and all-reduces across them."""
    proc = bed.sh(bed.nodes[0], "cd /root/proj && salloc -N3 --job-name=ptc-doctor "
                  "/root/.ptcluster/venv/bin/python -m ptcluster doctor --json", timeout=300,
                  check=False)
    report = json.loads(proc.stdout)
    a = report["allreduce"] or {}
    FIGURES["doctor in salloc -N3"] = (f"exit {proc.returncode}, {len(report['nodes'])} nodes, "
                                       f"all-reduce world {a.get('world_size')} over "
                                       f"{a.get('backend')}, {a.get('wrong')} wrong")
    assert len(report["nodes"]) == 3 and a.get("world_size") == 3 and a.get("wrong") == 0, \
        proc.stdout[-2000:] + proc.stderr[-2000:]


def test_a_fourth_node_joins(bed, work) -> None:
    put_data(bed, bed.add())
    work["cluster4"] = work["make4"](4, "c4.yaml")  # type: ignore[operator]
    proc, took = ptc(work, "--json", cluster="cluster4")
    OUTPUTS.extend([proc.stdout, proc.stderr])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    FIGURES["4th node added (s)"] = round(took, 1)
    assert report["slurm"]["ok"] and len(report["slurm"]["ran_on"]) == 4, report["slurm"]
    assert report["slurm"]["trainer"]["world_size"] == 4  # the trainer on all 4 (its summary)
    confs = {bed.sh(n, "sha256sum /etc/slurm/slurm.conf").stdout.split()[0] for n in bed.nodes}
    assert len(confs) == 1
    sinfo = bed.sh(bed.nodes[3], "sinfo -h -N -o '%N %t'").stdout
    FIGURES["sinfo with 4 nodes"] = sinfo.strip().replace("\n", " | ")
    assert [line.split()[1] for line in sinfo.splitlines()] == ["idle"] * 4, sinfo
    keys = {bed.sh(n, "sha256sum /etc/munge/munge.key").stdout.split()[0] for n in bed.nodes}
    assert len(keys) == 1


def test_a_removed_node_is_drained_then_taken_out(bed, work) -> None:
    """s13n3 leaves the cluster file while a job runs there: drained, kept in slurm.conf; once
    the job is gone, the next run takes it out."""
    n0 = bed.nodes[0]
    job = bed.sh(n0, "sbatch --parsable -w s13n3 -o /dev/null --wrap 'sleep 600'").stdout.strip()
    deadline = time.monotonic() + 60
    while "RUNNING" not in bed.sh(n0, f"squeue -h -j {job} -o %T").stdout:
        assert time.monotonic() < deadline, "the job on s13n3 never ran"
        time.sleep(0.5)
    proc, _ = ptc(work, "--json", "--slurm-proof", "srun")  # the 3-node file
    OUTPUTS.extend([proc.stdout, proc.stderr])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = json.loads(proc.stdout)["slurm"]
    assert said["ok"] and said["draining"] == [{"node": "s13n3", "jobs": [job]}], said
    state = bed.sh(n0, "sinfo -h -n s13n3 -o %t").stdout.strip()
    FIGURES["removed node with a job"] = state
    assert state in ("drng", "drain"), state
    assert bed.sh(n0, f"squeue -h -j {job} -o %T").stdout.strip() == "RUNNING"
    bed.sh(n0, f"scancel {job}")
    while bed.sh(n0, "squeue -h -w s13n3 -o %i").stdout.strip():
        assert time.monotonic() < deadline + 60
        time.sleep(0.5)
    proc, _ = ptc(work, "--json", "--slurm-proof", "srun")
    OUTPUTS.extend([proc.stdout, proc.stderr])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = json.loads(proc.stdout)["slurm"]
    assert said["ok"] and said["removed"] == ["s13n3"], said
    sinfo = bed.sh(n0, "sinfo -h -N -o '%N %t'").stdout
    FIGURES["sinfo after removal"] = sinfo.strip().replace("\n", " | ")
    assert sinfo.split() == ["s13n0", "idle", "s13n1", "idle", "s13n2", "idle"], sinfo
    for node in bed.nodes[:3]:
        assert "s13n3" not in bed.sh(node, "cat /etc/slurm/slurm.conf").stdout
