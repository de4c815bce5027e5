"""Hot spares (``spares:``) on a 5-node testbed: 3 nodes, each with its own workdir (its own
checkpoints), and 2 spares. A node's link is cut during the reference trainer's run: the next
attempt runs on a spare (which gets the checkpoint over the process group from a node that has
it), the rendezvous moves when the lost node hosted it, a spare that cannot be reached when it
should join is dropped (not counted as a restart) and the next spare joins, and with two nodes
lost and one spare the shrink rule takes the other; a spare refused by its health gate is
passed over like one that cannot be reached. Without spares, a lost node that answers again
is taken back at the next restart, and with ``--readmit`` at the next checkpoint; either way the
final parameters equal those of the same training unbroken (max abs difference <= 1e-5: the
world size changed on the way). ``doctor`` checks a spare as a node (its
all-reduce too); ``ps`` lists it, idle. The rule's details: ``tests/unit/test_spares.py``."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.head import Head, job_id_when_started, only_run, rank_fields, run_head
from tests.support.procs import is_rank, job_processes
from tests.support.testbed import full_workdir, next_port
from tests.testbed.test_run import RANKS

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
TRAIN = ["-m", "ptcluster.examples.mnist", "--no-download", "--dataset", "digits",
         "--batch-size", "32", "--epochs", "20", "--checkpoint-every-steps", "4"]


@pytest.fixture(scope="module")
def testbed():
    """5 namespace nodes for the module: nodes[0..2] are the cluster's nodes, nodes[3..4] its
    spares (torn down even on failure)."""
    from tests.support.testbed import Testbed, available, bring_up

    bed = bring_up("multi-node testbed", available(), lambda: Testbed(5))
    try:
        yield bed
    finally:
        bed.close()


def cluster(testbed, root: Path, slots: tuple[int, ...], spares: tuple[int, ...]) -> Path:
    """nodes[i] with ``slots[i]``, then the spares nodes[3..] with ``spares[j]`` slots; each
    machine its own workdir under ``root``."""
    lines = []
    for key, first, counts in (("nodes", 0, slots), ("spares", 3, spares)):
        lines.append(f"{key}:")
        for i, n in enumerate(counts, start=first):
            (root / f"w{i}").mkdir(exist_ok=True)
            lines.append(f"  - {{host: {testbed.nodes[i].name}, slots: {n}, "
                         f"workdir: {root / f'w{i}'}}}")
    lines += [f"master: {{port: {next_port()}}}", f"ssh: {{config_file: {testbed.ssh_config}}}",
              f"python: {sys.executable}"]
    path = root / "cluster.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_and_cut(testbed, root: Path, no_leftovers: list[str], path: Path, victims: list[int],
                *args: str, cut_first: tuple[int, ...] = ()) -> tuple[Head, dict, str]:
    """The trainer with restarts; ``victims``' links cut at epoch 3 (``cut_first``'s before
    it starts); every link restored after. The head (ended), summary.json and its stderr."""
    runs = root / "runs"
    for i in cut_first:
        testbed.cut_link(testbed.nodes[i])
    head = Head(["run", "--cluster", str(path), "--run-dir", str(runs), *args, *TRAIN],
                cwd=root)
    try:
        job_id = job_id_when_started(runs)
        no_leftovers.append(job_id)
        head.wait_for("epoch 3/20", timeout=120)
        for i in victims:
            testbed.cut_link(testbed.nodes[i])
        code = head.wait(timeout=300)
        left = [p for p, _ in job_processes(job_id, wait=30)]  # a cut-off guard ends itself
    finally:
        for i in (*cut_first, *victims):
            testbed.restore_link(testbed.nodes[i])
        if head.proc.poll() is None:
            head.kill()
    assert code == 0, head.output()
    assert left == [], left
    _, summary = only_run(runs)
    return head, summary, "\n".join(head.err)


TRAIN_40 = [a if a != "20" else "40" for a in TRAIN]
FINAL_40 = "checkpoint-39.pt"
"""The trainer's file after its last (40th) epoch."""


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TRAIN_40 run without a failure, on 2 local ranks of 64 (the global batch of 4 ranks of
    32: the trainer keeps it in every world size): the folder of its final checkpoint."""
    root = tmp_path_factory.mktemp("unbroken")
    code, head = run_head(["run", "--nproc", "2", *[a if a != "32" else "64" for a in TRAIN_40]],
                          cwd=root)
    assert code == 0, head.output()
    return root / "checkpoints"


def as_unbroken(workdir: Path, unbroken: Path) -> None:
    """The job's final parameters (``workdir``'s checkpoint) equal the unbroken run's within
    float rounding: its world size changed on the way (4, 3, 4 ranks against 2)."""
    want = torch.load(unbroken / FINAL_40, weights_only=False)
    got = torch.load(workdir / "checkpoints" / FINAL_40, weights_only=False)
    assert got["global_batch"] == want["global_batch"] == 128, (got["global_batch"],
                                                               want["global_batch"])
    worst = max((got["model"][k] - t).abs().max().item() for k, t in want["model"].items())
    assert worst <= 1e-5, worst


def one_model(head: Head, world: int) -> dict[int, dict[str, str]]:
    ranks = rank_fields(head.lines)
    assert sorted(ranks) == list(range(world)), head.output()
    assert len({r["params_sha256"] for r in ranks.values()}) == 1, ranks
    return ranks


def test_the_rendezvous_node_lost_a_spare_takes_its_place_at_the_same_world_size(
        testbed, tmp_path, no_leftovers) -> None:
    n = [x.name for x in testbed.nodes]
    path = cluster(testbed, tmp_path, (2, 1, 1), (2,))
    head, s, err = run_and_cut(testbed, tmp_path, no_leftovers, path, [0],
                               "--max-restarts", "1")  # (--min-nodes: all 3, the default)
    first, second = s["attempts"]
    assert first["cause"]["host"] == n[0] and first["cause"]["kind"] == "lost", first
    assert first["dropped"] == [n[0]] and first["replaced"] == {n[0]: n[3]}, first
    assert s["spares"] == [{"after_attempt": 0, "node": n[0], "spare": n[3], "why": "lost"}]
    assert second["hosts"] == [n[1], n[2], n[3]] and second["world_size"] == 4, second
    assert second["ok"] and second["resumed_from"] == first["checkpoint"], (first, second)
    assert f"restart 1 of 1: spare {n[3]} replaces {n[0]} (lost)" in err, err
    assert second["world_size"] == first["world_size"], (first, second)  # (the slots match)
    # the next rendezvous on the next node of the file; the spare's ranks last
    plan = json.loads((tmp_path / "runs" / s["job_id"] / "plan.1.json").read_text())
    assert plan["master_addr"] == n[1], plan["master_addr"]
    ranks = one_model(head, 4)
    assert {r["start_step"] for r in ranks.values()} == {str(second["resumed_from"])}, ranks
    # the spare had no checkpoint of its own: it got the one the nodes had, and kept a copy
    assert list((tmp_path / "w3" / "checkpoints").iterdir()), "the spare saved none"


def test_a_spare_that_cannot_join_is_dropped_and_the_next_spare_joins(
        testbed, tmp_path, no_leftovers) -> None:
    """The first spare's link is down: its join fails before any rank starts (named, not a
    restart); the second, with 2 slots for the lost node's 1, joins: world size 5."""
    n = [x.name for x in testbed.nodes]
    path = cluster(testbed, tmp_path, (2, 1, 1), (1, 2))
    head, s, err = run_and_cut(testbed, tmp_path, no_leftovers, path, [2],
                               "--max-restarts", "1", cut_first=(3,))
    first, joining, last = s["attempts"]
    assert first["replaced"] == {n[2]: n[3]}, first
    assert joining["hosts"] == [n[0], n[1], n[3]] and not joining["ok"], joining
    assert joining["cause"]["host"] == n[3], joining["cause"]
    assert joining["cause"]["kind"] in ("start", "lost"), joining["cause"]
    assert joining["replaced"] == {n[3]: n[4]}, joining
    assert last["ok"] and last["hosts"] == [n[0], n[1], n[4]] and last["world_size"] == 5
    assert [(x["node"], x["spare"]) for x in s["spares"]] == [(n[2], n[3]), (n[3], n[4])]
    assert s["spares"][1]["why"] in ("could not start", "lost"), s["spares"]  # (unreachable)
    assert f"spare {n[3]} failed to join, not counted as a restart; restart 1 of 1: spare " \
           f"{n[4]} replaces {n[3]}" in err, err
    assert f"world size 5 (was 4: {n[4]} has 2 slot(s), {n[3]} had 1)" in err, err
    one_model(head, 5)


def test_two_nodes_lost_with_one_spare_the_job_goes_on_smaller(
        testbed, tmp_path, no_leftovers) -> None:
    n = [x.name for x in testbed.nodes]
    path = cluster(testbed, tmp_path, (2, 1, 1), (1,))
    head, s, err = run_and_cut(testbed, tmp_path, no_leftovers, path, [1, 2],
                               "--max-restarts", "1", "--min-nodes", "2")
    first, second = s["attempts"]
    assert sorted(first["dropped"]) == [n[1], n[2]], first
    assert len(first["replaced"]) == 1 and set(first["replaced"].values()) == {n[3]}, first
    assert second["ok"] and second["hosts"] == [n[0], n[3]] and second["world_size"] == 3
    assert f"spare {n[3]} replaces" in err and "; without " in err, err
    one_model(head, 3)


def test_doctor_checks_a_spare_as_a_node_and_ps_lists_it_idle(testbed, tmp_path) -> None:
    n = [x.name for x in testbed.nodes]
    path = cluster(testbed, tmp_path, (1, 1), (1,))
    code, head = run_head(["doctor", "--cluster", str(path), "--json", "--timeout", "30"],
                          cwd=tmp_path, timeout=120)
    report = json.loads("\n".join(head.lines))
    assert code == 0 and report["ok"], report["findings"]
    assert report["spares"] == [n[3]] and n[3] in report["nodes"]
    assert report["allreduce"]["world_size"] == 3 and report["allreduce"]["wrong"] == 0
    checks = {(f["check"], f["host"]) for f in report["findings"]}
    assert ("interface", n[3]) in checks and ("ports", n[3]) in checks, checks
    code, head = run_head(["ps", "--cluster", str(path), "--json"], cwd=tmp_path, timeout=60)
    listing = json.loads("\n".join(head.lines))
    assert code == 0, head.output()
    assert listing["spares"] == [{"host": n[3], "slots": 1, "reachable": True, "jobs": []}]


def test_a_spare_refused_by_its_health_gate_is_passed_over(testbed, tmp_path,
                                                            no_leftovers) -> None:
    """node 2 and the first spare have full workdir disks: node 2 is refused at the start, the
    first spare when it joins (not counted), the second spare runs the job: world size 3."""
    n = [x.name for x in testbed.nodes]
    (tmp_path / "ranks.py").write_text(RANKS)
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, 0o777)
    with full_workdir(testbed.nodes[2], tmp_path / "full2", RANKS) as full2, \
            full_workdir(testbed.nodes[3], tmp_path / "full3", RANKS) as full3:
        lines = ["nodes:"] + [f"  - {{host: {n[i]}, slots: 1{w}}}" for i, w in
                              ((0, ""), (1, ""), (2, f", workdir: {full2}"))]
        lines += ["spares:", f"  - {{host: {n[3]}, slots: 1, workdir: {full3}}}",
                  f"  - {{host: {n[4]}, slots: 1}}", f"master: {{port: {next_port()}}}",
                  f"ssh: {{config_file: {testbed.ssh_config}}}", f"python: {sys.executable}",
                  f"workdir: {tmp_path}"]
        (tmp_path / "cluster.yaml").write_text("\n".join(lines) + "\n")
        code, head = run_head(["run", "--cluster", "cluster.yaml", "--run-dir", "runs",
                               "--max-restarts", "1", "ranks.py", str(out)],
                              cwd=tmp_path, timeout=240)
        no_leftovers.append(only_run(tmp_path / "runs")[0])
    assert code == 0, head.output()
    _, s = only_run(tmp_path / "runs")
    first, joining, last = s["attempts"]
    assert (first["cause"]["host"], first["cause"]["kind"]) == (n[2], "unhealthy"), first
    assert first["replaced"] == {n[2]: n[3]}, first
    assert (joining["cause"]["host"], joining["cause"]["kind"]) == (n[3], "unhealthy")
    assert joining["dropped_why"][n[3]].startswith("unhealthy: its workdir disk is nearly full")
    assert joining["replaced"] == {n[3]: n[4]}, joining
    assert last["ok"] and last["hosts"] == [n[0], n[1], n[4]] and last["world_size"] == 3
    err = "\n".join(head.err)
    assert f"spare {n[3]} failed to join, not counted as a restart; restart 1 of 1: spare " \
           f"{n[4]} replaces {n[3]} (unhealthy: its workdir disk is nearly full" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank1.json", "rank2.json"]
    assert json.loads((out / "rank2.json").read_text())["host"] == n[4]


def rank_pid(testbed, job_id: str, node) -> int | None:
    """A rank of ``job_id`` on ``node`` (torchrun's or a warm pool's: ``procs.is_rank``)."""
    for pid, _ in job_processes(job_id):
        if is_rank(pid) and testbed.node_of_pid(pid) is node:
            return pid
    return None


def test_a_lost_node_that_answers_again_is_taken_back_at_the_next_restart(
        testbed, tmp_path, no_leftovers, unbroken) -> None:
    """No spare: node 2 is cut, the job goes on without it (--min-nodes 2); its link comes
    back and its guard of then ends; a rank of node 0 is killed: the next attempt takes node 2
    back, the job ends at full size (world size 4), one model on every rank."""
    n = [x.name for x in testbed.nodes]
    path = cluster(testbed, tmp_path, (2, 1, 1), ())
    runs = tmp_path / "runs"
    train = TRAIN_40
    head = Head(["run", "--cluster", str(path), "--run-dir", str(runs), "--max-restarts", "2",
                 "--min-nodes", "2", *train], cwd=tmp_path)
    victim = testbed.nodes[2]
    try:
        job_id = job_id_when_started(runs)
        no_leftovers.append(job_id)
        head.wait_for("epoch 3/40", timeout=120)
        testbed.cut_link(victim)
        head.err_line(f"restart 1 of 2 without {n[2]}", timeout=120)
        testbed.restore_link(victim)
        since = len(head.lines)  # attempt 1 makes progress (saves checkpoints) first
        deadline = time.monotonic() + 120
        while sum("epoch " in line for line in head.lines[since:]) < 2:
            assert time.monotonic() < deadline and head.proc.poll() is None, head.output()
            time.sleep(0.2)
        while (pid := rank_pid(testbed, job_id, testbed.nodes[0])) is None:
            assert time.monotonic() < deadline and head.proc.poll() is None, head.output()
            time.sleep(0.05)
        os.kill(pid, signal.SIGSTOP)  # (attempt 1 held: a warm one ends in seconds)
        deadline = time.monotonic() + 90  # its guard ends itself (no head for 15 s)
        while any(testbed.node_of_pid(p) is victim for p, _ in job_processes(job_id)):
            assert time.monotonic() < deadline, job_processes(job_id)
            time.sleep(0.5)
        assert head.proc.poll() is None, head.output()
        os.kill(pid, signal.SIGKILL)
        code = head.wait(timeout=300)
        left = [p for p, _ in job_processes(job_id, wait=30)]
    finally:
        testbed.restore_link(victim)
        if head.proc.poll() is None:
            head.kill()
    assert code == 0, head.output()
    assert left == [], left
    _, s = only_run(runs)
    first, second, third = s["attempts"]
    assert first["dropped"] == [n[2]] and second["hosts"] == [n[0], n[1]], (first, second)
    assert second["cause"]["host"] == n[0] and second["readmitted"] == [n[2]], second
    assert third["ok"] and third["hosts"] == n[:3] and third["world_size"] == 4, third
    err = "\n".join(head.err)
    assert f"restart 2 of 2: {n[2]} answers again: taken back" in err, err
    assert f"world size 4 (was 3: {n[2]} taken back)" in err, err
    one_model(head, 4)
    as_unbroken(tmp_path / "w0", unbroken)


def test_with_readmit_a_node_back_rejoins_at_the_next_checkpoint_every_rank_saved(
        testbed, tmp_path, no_leftovers, unbroken) -> None:
    """``run --readmit``, no spare: node 2 is cut, the job goes on without it (--min-nodes 2);
    its link comes back: once its guard of then has ended and its health gate passes, a
    planned restart at the next checkpoint every rank saved takes it back, without a failure
    and not counted as a restart (--max-restarts 1 was spent on the loss). The job ends at
    full size (world size 4), one model on every rank, no process left."""
    n = [x.name for x in testbed.nodes]
    path = cluster(testbed, tmp_path, (2, 1, 1), ())
    runs = tmp_path / "runs"
    train = TRAIN_40
    head = Head(["run", "--cluster", str(path), "--run-dir", str(runs), "--max-restarts", "1",
                 "--min-nodes", "2", "--readmit", *train], cwd=tmp_path)
    victim = testbed.nodes[2]
    try:
        job_id = job_id_when_started(runs)
        no_leftovers.append(job_id)
        head.wait_for("epoch 3/40", timeout=120)
        testbed.cut_link(victim)
        head.err_line(f"restart 1 of 1 without {n[2]}", timeout=120)
        testbed.restore_link(victim)
        head.err_line(f"{n[2]} answers again and passed its health gate", timeout=120)
        code = head.wait(timeout=300)
        left = [p for p, _ in job_processes(job_id, wait=30)]
    finally:
        testbed.restore_link(victim)
        if head.proc.poll() is None:
            head.kill()
    assert code == 0, head.output()
    assert left == [], left
    _, s = only_run(runs)
    first, second, third = s["attempts"]
    assert first["dropped"] == [n[2]] and second["hosts"] == [n[0], n[1]], (first, second)
    assert second["end"] == "planned restart" and second["cause"] is None, second
    step = second["planned_step"]
    assert step is not None and step > (second["resumed_from"] or 0), second
    assert second["readmitted"] == [n[2]], second
    assert third["ok"] and third["end"] == "succeeded", third
    assert third["hosts"] == n[:3] and third["world_size"] == 4, third
    assert third["resumed_from"] >= step, (second, third)  # (a save after the stop: newer)
    assert third["downtime_s"] is not None, third  # (the planned restart's own cost)
    err = "\n".join(head.err)
    assert f"{n[2]} is back: a planned restart at step {step} (the checkpoint every rank " \
           "saved) takes it back" in err, err
    assert f"planned restart at step {step} (--readmit, not counted as a restart): {n[2]} " \
           "taken back" in err, err
    assert f"world size 4 (was 3: {n[2]} taken back)" in err, err
    one_model(head, 4)
    as_unbroken(tmp_path / "w0", unbroken)


def test_with_readmit_a_node_back_while_a_spare_holds_its_place_waits_as_a_spare(
        testbed, tmp_path, no_leftovers) -> None:
    """``run --readmit`` with a spare: node 2 is cut, the spare takes its place (world size
    4); node 2's link comes back: it is said to wait as a spare, no planned restart follows
    (the job never grows past the cluster file's 3 nodes), the job ends on the spare."""
    n = [x.name for x in testbed.nodes]
    path = cluster(testbed, tmp_path, (2, 1, 1), (1,))
    runs = tmp_path / "runs"
    train = [a if a != "20" else "40" for a in TRAIN]  # (time for its guard of then to end)
    head = Head(["run", "--cluster", str(path), "--run-dir", str(runs), "--max-restarts", "1",
                 "--readmit", *train], cwd=tmp_path)
    victim = testbed.nodes[2]
    try:
        job_id = job_id_when_started(runs)
        no_leftovers.append(job_id)
        head.wait_for("epoch 3/40", timeout=120)
        testbed.cut_link(victim)
        head.err_line(f"restart 1 of 1: spare {n[3]} replaces {n[2]}", timeout=120)
        testbed.restore_link(victim)
        head.err_line(f"{n[2]} answers again but a spare holds its place: it waits as a spare",
                      timeout=120)
        code = head.wait(timeout=300)
        left = [p for p, _ in job_processes(job_id, wait=30)]
    finally:
        testbed.restore_link(victim)
        if head.proc.poll() is None:
            head.kill()
    assert code == 0, head.output()
    assert left == [], left
    _, s = only_run(runs)
    first, second = s["attempts"]
    assert first["replaced"] == {n[2]: n[3]}, first
    assert second["ok"] and second["hosts"] == [n[0], n[1], n[3]], second
    assert second["world_size"] == 4 and second["planned_step"] is None, second
    assert first["planned_step"] is None, first  # (a spare's restart, not a planned one)
    one_model(head, 4)
