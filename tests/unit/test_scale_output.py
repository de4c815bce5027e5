"""What a user reads on a cluster of hundreds of nodes: run's header and closing table, and
doctor's report, stay about one screen (every node and rank is in the run directory and in
``doctor --json``); on a few nodes they are as before, one line or column per node."""

from __future__ import annotations

import io

from ptcluster.cli import doctor_cmd, run_cmd
from ptcluster.cli.console import terminal
from ptcluster.cluster.load import parse_cluster_text
from ptcluster.doctor.checks import FAIL, OK, WARN, Finding
from ptcluster.doctor.diagnose import DoctorReport
from ptcluster.launch.plan import Target, plan_launch
from ptcluster.launch.result import RankRecord, RunResult


def written(draw) -> str:  # type: ignore[no-untyped-def]
    out = io.StringIO()
    draw(terminal(file=out, width=200))
    return out.getvalue()


GOLDEN_THREE = """\
ptcluster doctor
┏━━━━━━━┳━━━━┳━━━━━━┳━━━━┓
┃ check ┃ a  ┃ b    ┃ c  ┃
┡━━━━━━━╇━━━━╇━━━━━━╇━━━━┩
│ ssh   │ ok │ ok   │ ok │
│ ports │ -  │ FAIL │ -  │
└───────┴────┴──────┴────┘
  FAIL ports: b: refused. Fix: open it
1 check(s) failed (1.0 s)
"""
"""Doctor on three nodes, whole: a column per node (``-``: not run there), the failure with its
fix, the verdict (lines compared without the title's padding)."""


def cells(lines: list[str], bar: str) -> list[list[str]]:
    """A Rich table's rows (``│``) or header (``┃``) as lists of its cells' text."""
    return [[cell.strip() for cell in line.split(bar)[1:-1]] for line in lines
            if line.startswith(bar)]


def cluster(n: int, slots: int = 8) -> str:
    return "nodes:\n" + "".join(f"  - {{host: n{i:04d}, slots: {slots}}}\n" for i in range(n))


def test_the_header_of_a_1024_node_job_lists_ten_nodes_and_says_where_the_rest_are() -> None:
    plan = plan_launch(parse_cluster_text(cluster(1024), "c.yaml"), Target(script="t.py"),
                       port=29500, job_id="J")
    out = written(lambda c: run_cmd._print_plan(c, plan, "runs/J")).splitlines()

    def node(i: int) -> str:
        return f"  node {i} {f'n{i:04d}':<16} ranks {8 * i}..{8 * i + 7}  interface auto  " \
               f"workdir {plan.nodes[i].workdir}"
    assert out == ["ptcluster job J: world size 8192 on 1024 node(s), rendezvous n0000:29500, "
                   "backend auto", *[node(i) for i in range(8)],
                   "  ... 1014 more node(s), ranks 64..8175 (every node: runs/J/plan.json)",
                   node(1022), node(1023), "  logs: runs/J/"], out
    small = plan_launch(parse_cluster_text(cluster(10, 1), "c.yaml"), Target(script="t.py"),
                        port=29500, job_id="J")
    out = written(lambda c: run_cmd._print_plan(c, small, "runs/J")).splitlines()
    assert [line.split()[1] for line in out[1:11]] == [str(i) for i in range(10)]


def test_the_closing_table_of_8192_ranks_names_the_failed_one_and_counts_the_rest() -> None:
    ranks = [RankRecord(rank=r, host=f"n{r // 8:04d}", local_rank=r % 8, started_at=0.0,
                        exit_code=-15, stopped=True, duration=20.0 + r / 8192)
             for r in range(8192)]
    ranks[17] = RankRecord(rank=17, host="n0002", local_rank=1, started_at=0.0, exit_code=1,
                           duration=12.5)
    rows = run_cmd.rank_rows(RunResult(job_id="J", run_dir="d", ranks=ranks, duration=21.0,
                                      nodes=[], failures=[], interrupted=False))
    assert rows == [("17", "n0002", "1", "exit 1", False, "12.5 s"),
                    ("8191 ranks", "1024 node(s)", "", "stopped (job teardown)", False,
                     "20.0 s .. 21.0 s")]
    few = run_cmd.rank_rows(RunResult(job_id="J", run_dir="d", ranks=ranks[:32], nodes=[],
                                       failures=[], interrupted=False, duration=21.0))
    assert [row[0] for row in few] == [str(r) for r in range(32)]


def test_the_closing_table_of_a_hang_names_the_hung_rank_apart_from_the_stopped_ones() -> None:
    """A --hang-timeout run: the teardown stops every rank, the one the hang report named
    among them; the table says which it was (as the root cause above it does)."""
    def table(n: int) -> list[tuple[str, str, str, str, bool, str]]:
        ranks = [RankRecord(rank=r, host=f"n{r // 8:04d}", local_rank=r % 8, started_at=0.0,
                            exit_code=-15, stopped=True, duration=30.0, hung=r == 3)
                 for r in range(n)]
        return run_cmd.rank_rows(RunResult(job_id="J", run_dir="d", ranks=ranks, nodes=[],
                                            failures=[], interrupted=False, duration=31.0))

    assert [row[3] for row in table(4)] == ["stopped (job teardown)"] * 3 + \
        ["hung (named by the hang report)"]
    assert table(8192) == [("3", "n0000", "3", "hung (named by the hang report)", False,
                            "30.0 s"),
                           ("8191 ranks", "1024 node(s)", "", "stopped (job teardown)", False,
                            "30.0 s .. 30.0 s")]


def test_doctor_on_40_nodes_counts_per_check_and_says_each_thing_once() -> None:
    hosts = [f"n{i:02d}" for i in range(40)]
    findings = [Finding.plain("ssh", h, OK, "BatchMode ssh ok") for h in hosts]
    findings += [Finding.plain("interface", h, OK, f"eth0 (detected) 10.0.0.{i}/24")
                 for i, h in enumerate(hosts)]
    findings += [Finding.plain("ports", h, FAIL if i < 38 else OK,
                         "10.0.0.1:41000 refused" if i < 38 else "reached",
                         "allow TCP between cluster nodes" if i < 38 else None)
                 for i, h in enumerate(hosts)]
    findings.append(Finding.plain("clock", "n07", WARN, "clock 2.1 s from the median", "run NTP"))
    out = written(lambda c: doctor_cmd.render(
        c, DoctorReport(findings=findings, probes={}, duration=1.0), hosts))
    lines = [line.rstrip() for line in out.splitlines()]  # (a title is padded to the table)
    end = next(i for i, line in enumerate(lines) if line.startswith("└"))
    assert lines[0] == "ptcluster doctor: 40 nodes" and len(lines) < 40, out
    assert cells(lines[:end], "┃") == [["check", "ok", "warn", "FAIL", "-", "not passed on"]]
    assert cells(lines[:end], "│") == [["ssh", "40", "", "", "", ""],
                                      ["interface", "40", "", "", "", ""],
                                      ["ports", "2", "", "38", "", "n00, n01, n02 +35"],
                                      ["clock", "", "1", "", "39", "n07"]], out
    shown = doctor_cmd.LINES_PER_CHECK[OK]  # (every node: `doctor --json`)
    assert lines[end + 1:] == [
        *[f"  ok   interface: n{i:02d}: eth0 (detected) 10.0.0.{i}/24" for i in range(shown)],
        f"  ... interface: {40 - shown} more node(s) (`ptcluster doctor --json` has every one)",
        "  FAIL ports: n00, n01 +36: 10.0.0.1:41000 refused. Fix: allow TCP between cluster nodes",
        "  warn clock: n07: clock 2.1 s from the median. Fix: run NTP",
        "1 check(s) failed on 38 nodes (1.0 s)"], out


def test_doctor_on_three_nodes_keeps_a_column_per_node() -> None:
    findings = [Finding.plain("ssh", h, OK, "ok") for h in ("a", "b", "c")]
    findings.append(Finding.plain("ports", "b", FAIL, "refused", "open it"))
    out = written(lambda c: doctor_cmd.render(
        c, DoctorReport(findings=findings, probes={}, duration=1.0), ["a", "b", "c"]))
    assert [line.rstrip() for line in out.splitlines()] == GOLDEN_THREE.splitlines(), out


def test_a_hang_of_8192_ranks_and_a_deadline_on_1024_nodes_are_a_line_each() -> None:
    from ptcluster.launch.stacks.report import Group, RankStack
    from ptcluster.launch.supervise.verdict import not_ready, timed_out

    group = Group(ranks=[RankStack(rank=r, host=f"n{r // 8:04d}", error="gone")
                         for r in range(8192) if r != 17])
    assert group.label() == "ranks 0-16,18-8191 on n0000,n0001,n0002 +1021 more: no stack (gone)"
    running = [RankRecord(rank=r, host=f"n{r // 8:04d}", local_rank=r % 8) for r in range(8192)]
    late = timed_out(running, "n0000", 600.0, at=0.0)
    assert late.host == "n0000, n0001, n0002 +1021 more"
    assert late.message.endswith("ranks still running: 0, 1, 2, 3, 4, 5, 6, 7 +8184 more")
    assert not_ready([f"n{i}" for i in range(300)], 60, 0.0).host == "n0, n1, n2 +297 more"
