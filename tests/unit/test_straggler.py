"""The straggler report's pure parts: the rule over a window (``launch.supervise.straggler``), its
hysteresis, the guard's /proc figures (``node.guard.schedstat``) and the ``timing`` frame's
decoding."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.straggler import (
    CONFIRM,
    DEFAULT_THRESHOLD,
    EVAL_EVERY,
    RankFigures,
    StragglerWatch,
    candidates,
    find_straggler,
)
from ptcluster.node import wire
from ptcluster.node.guard.schedstat import SchedstatMeter, main_thread_schedstat

HOSTS = {0: "n0", 1: "n1", 2: "n2"}


def fig(rank: int, wait: float, starved: float = 0.05, host: str | None = None,
        collectives: int | None = 100) -> RankFigures:
    """A rank's 6 s window with the given wait and starved shares."""
    span = 6.0
    return RankFigures(rank=rank, host=host or HOSTS.get(rank, f"n{rank}"), span=span,
                       run=span * (1 - wait - starved), delay=span * starved,
                       collectives=collectives)


@pytest.mark.parametrize(("waits", "threshold", "named"), [
    ((0.50, 0.52, 0.48), DEFAULT_THRESHOLD, None),          # balanced
    ((0.73, 0.75, 0.45), DEFAULT_THRESHOLD, (2,)),          # others wait for rank 2
    ((0.73, 0.75, 0.45), 2.5, None),                         # ... by less than 2.5x
    ((0.10, 0.12, 0.00), DEFAULT_THRESHOLD, None),           # nobody waits: no straggler
    ((0.80, 0.30, 0.82), DEFAULT_THRESHOLD, (1,)),
])
def test_the_rule_names_the_rank_the_others_wait_for(waits, threshold, named) -> None:
    figures = {r: fig(r, w) for r, w in enumerate(waits)}
    verdict = find_straggler(figures, {}, threshold)
    assert (None if verdict is None else verdict.ranks) == named


def test_every_rank_of_one_node_is_named_as_the_node() -> None:
    figures = {0: fig(0, 0.7, host="a"), 1: fig(1, 0.72, host="a"),
               2: fig(2, 0.2, host="b"), 3: fig(3, 0.25, host="b")}
    verdict = find_straggler(figures, {}, DEFAULT_THRESHOLD)
    assert verdict is not None and verdict.whole_node and verdict.ranks == (2, 3)
    assert verdict.who == "b (ranks 2,3)"
    # one slow rank of b: b as a node is not slow, its rank is
    figures[3] = fig(3, 0.7, host="b")
    verdict = find_straggler(figures, {}, DEFAULT_THRESHOLD)
    assert verdict is not None and verdict.ranks == (2,) and not verdict.whole_node


@pytest.mark.parametrize(("starved", "node", "seen", "why"), [
    (0.40, {}, {"cpu_starved": 0.40},
     "n2's CPU is saturated (its main thread waited 40% of the time for a CPU)"),
    (0.10, {}, {}, "why unknown"),
    (0.10, {"mem_available": 0.05}, {"mem_available": 0.05},
     "n2 is short of memory (5% available)"),
    (0.10, {"gpu_util": 20.0}, {"gpu_util": 20.0}, "n2's GPU util is low (20%)"),
    (0.10, {"mem_available": 0.5, "gpu_util": 95.0}, {}, "why unknown"),
    # a CPU quota: the main thread slept through it (Linux 6.18 dequeues a throttled task)
    (0.10, {"cpu_throttled": 0.9}, {"cpu_throttled": 0.9},
     "n2's CPU is saturated (a CPU quota throttled its ranks in 90% of its periods)"),
    (0.10, {"cpu_throttled": 0.1}, {}, "why unknown"),
    (0.40, {"cpu_throttled": 0.9}, {"cpu_starved": 0.40},
     "n2's CPU is saturated (its main thread waited 40% of the time for a CPU)"),
])
def test_why_is_only_what_the_node_saw(starved, node, seen, why) -> None:
    figures = {0: fig(0, 0.75), 1: fig(1, 0.75), 2: fig(2, 0.40, starved=starved)}
    (verdict,) = [v for v in candidates(figures, {"n2": node}) if v.ranks == (2,)]
    assert verdict.seen == pytest.approx(seen) and verdict.to_json()["seen"] == verdict.seen
    assert verdict.why == why  # (the words: the rendering of what was seen)


def test_the_line_says_who_how_much_and_why() -> None:
    figures = {0: fig(0, 0.75, collectives=300), 1: fig(1, 0.75, collectives=300),
               2: fig(2, 0.45, starved=0.4, collectives=300)}
    verdict = find_straggler(figures, {}, DEFAULT_THRESHOLD)
    assert verdict is not None
    # the others waited 2 x 6 s x 0.75 = 9 s over 600 collectives
    assert verdict.wait_per_collective == pytest.approx(0.015)
    assert verdict.ratio == round(0.55 / 0.25, 2)
    line = verdict.line()
    assert line == (
        "rank 2 on n2 is the straggler: the other ranks wait 0.015 s per collective (75% of "
        "their time) for it (its steps take 2.2x the median); n2's CPU is saturated (its main "
        "thread waited 40% of the time for a CPU)")
    figures = {r: fig(r, f.wait_share, f.starved_share, collectives=None)
               for r, f in figures.items()}
    verdict = find_straggler(figures, {}, DEFAULT_THRESHOLD)
    assert verdict is not None and verdict.wait_per_collective is None  # (no recorder)
    assert verdict.line() == line.replace("0.015 s per collective (75% of their time)",
                                          "75% of their time")


def frames(watch: StragglerWatch, waits: dict[int, float], starved: float = 0.05,
           collectives: int | None = 50) -> None:
    """One 2 s timing frame from every node."""
    for rank, wait in waits.items():
        watch.report(HOSTS[rank], {rank: {"span": 2.0, "run": 2.0 * (1 - wait - starved),
                                          "delay": 2.0 * starved, "collectives": collectives}},
                     {"mem_available": 0.6})


def drive(watch: StragglerWatch, sequence: list[dict[int, float]], t0: float = 1000.0,
          **kw) -> list[tuple[float, str]]:
    said = []
    for i, waits in enumerate(sequence):
        at = t0 + i * EVAL_EVERY
        frames(watch, waits, **kw)
        line = watch.evaluate(at, set(waits))
        if line is not None:
            said.append((at, line))
    return said


BAL = {0: 0.50, 1: 0.52, 2: 0.48}
SLOW2 = {0: 0.74, 1: 0.73, 2: 0.45}
SLOW1 = {0: 0.74, 1: 0.40, 2: 0.75}
MILD2 = {0: 0.74, 1: 0.73, 2: 0.62}  # ratio ~1.4: under the threshold, over the release


def test_said_once_then_only_when_it_changes() -> None:
    watch = StragglerWatch()
    said = drive(watch, [BAL] * 4 + [SLOW2] * 10 + [SLOW1] * 8 + [BAL] * 8)
    lines = [line for _, line in said]
    assert len(lines) == 3, lines
    assert lines[0].startswith("rank 2 on n2 is the straggler: ")
    assert lines[1].startswith("rank 1 on n1 is the straggler: ")
    assert lines[2] == "no straggler any more (rank 1 on n1 keeps up)"
    assert [h["ranks"] for h in watch.history] == [[2], [1], []]
    assert [h["line"] for h in watch.history] == lines


def test_it_waits_for_full_windows_and_confirmation() -> None:
    watch = StragglerWatch()
    said = drive(watch, [SLOW2] * 10)
    # window of WINDOW reports, then CONFIRM evaluations in a row
    assert said and said[0][0] == 1000.0 + (watch.window - 1 + CONFIRM - 1) * EVAL_EVERY


def test_hysteresis_holds_between_release_and_threshold() -> None:
    watch = StragglerWatch()
    lines = [line for _, line in drive(watch, [SLOW2] * 6 + [MILD2] * 10)]
    assert len(lines) == 1 and watch.current is not None and watch.current.ranks == (2,)
    fresh = StragglerWatch()
    assert drive(fresh, [MILD2] * 10) == []  # never over the threshold: never named


def test_one_odd_evaluation_does_not_flap() -> None:
    watch = StragglerWatch(window=1)
    said = drive(watch, [SLOW2] * 4 + [BAL] + [SLOW2] * 4 + [SLOW1] + [SLOW2] * 3)
    assert len(said) == 1


def test_windows_without_collectives_are_not_judged() -> None:
    """At the start (imports, rendezvous) a slow node is slow, but no step has run yet."""
    watch = StragglerWatch()
    assert drive(watch, [SLOW2] * 8, collectives=0) == []
    assert len(watch.trace) == 0
    said = drive(watch, [SLOW2] * 8, t0=2000.0, collectives=40)
    assert said and said[0][1].startswith("rank 2 on n2")
    unknown = StragglerWatch()  # ranks that report no collectives (recorder off): judged
    assert drive(unknown, [SLOW2] * 8, collectives=None)


def test_only_running_ranks_and_a_full_set_are_compared() -> None:
    watch = StragglerWatch()
    for i in range(8):  # rank 2 ended: it is no longer compared, and 0 and 1 keep pace
        frames(watch, SLOW2)
        assert watch.evaluate(1000.0 + i * EVAL_EVERY, {0, 1}) is None
    assert watch.trace and all(set(t["ratios"]) == {"0", "1"} for t in watch.trace)
    watch = StragglerWatch()
    for i in range(8):
        frames(watch, {0: 0.74, 1: 0.73})  # rank 2's guard says nothing
        assert watch.evaluate(1000.0 + i * EVAL_EVERY, {0, 1, 2}) is None


def test_evaluations_are_paced_and_recorded() -> None:
    watch = StragglerWatch()
    for _ in range(3):
        frames(watch, BAL)
    assert watch.due(1000.0)
    watch.evaluate(1000.0, {0, 1, 2})
    frames(watch, BAL)
    assert not watch.due(1000.5)
    assert watch.due(1000.0 + EVAL_EVERY)
    out = watch.to_json()
    assert [r["rank"] for r in out["ranks"]] == [0, 1, 2]
    assert out["ranks"][1]["wait_share"] == pytest.approx(0.52)
    assert out["ranks"][1]["wait_share_job"] == pytest.approx(0.52)
    assert [r["collectives_job"] for r in out["ranks"]] == [200] * 3  # 4 frames of 50 each
    assert out["trace"] and set(out["trace"][0]["ratios"]) == {"0", "1", "2"}
    assert out["current"] is None and out["history"] == []


def test_threshold_is_validated() -> None:
    with pytest.raises(ValueError, match="> 1"):
        StragglerWatch(threshold=1.0)


def test_the_timing_frame_decodes() -> None:
    line = wire.encode(wire.Kind.TIMING, {"t": 1.0, "ranks": {"3": {"span": 2.0, "run": 0.5,
                                                             "delay": 0.2, "collectives": 9}},
                                     "node": {"mem_available": 0.4}}).decode().rstrip("\n")
    event = ev.decode("n1", line)
    assert event == ev.Timing("n1", {3: {"span": 2.0, "run": 0.5, "delay": 0.2,
                                         "collectives": 9}}, {"mem_available": 0.4})


def test_busy_meter_reads_a_sleeping_and_a_spinning_thread() -> None:
    """The guard's figures from /proc: a process whose main thread sleeps shows a high wait
    share, one that spins a low one (here: this test's own process, its main thread busy)."""
    assert main_thread_schedstat(os.getpid()) is not None
    assert main_thread_schedstat(2 ** 22 + 12345) is None
    meter = SchedstatMeter()
    pid = os.getpid()
    assert meter.sample({0: pid}, {0: 10}, time.monotonic()) == {}
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.3:
        pass
    got = meter.sample({0: pid}, {0: 15}, time.monotonic())["0"]
    assert got["collectives"] == 5
    assert (got["run"] + got["delay"]) / got["span"] > 0.8
    time.sleep(0.3)
    got = meter.sample({0: pid}, {}, time.monotonic())["0"]
    assert got["collectives"] is None and got["run"] / got["span"] < 0.3
    assert meter.sample({}, {}, time.monotonic()) == {} and meter.last == {}
    assert "mem_available" in meter.node()
    assert threading.main_thread().is_alive()


@pytest.mark.parametrize("value", ["1", "0.5", "nan", "inf", "x"])
def test_run_refuses_a_threshold_that_names_everyone(cli, value) -> None:
    code, _, err = cli("run", "--straggler-threshold", value, "x.py")
    assert code == 2 and "--straggler-threshold" in err


def test_monitor_cell_per_node() -> None:
    from ptcluster.monitor.watch import node_waits

    figures = {"ranks": [{"rank": 0, "host": "a", "wait_share": 0.75},
                         {"rank": 1, "host": "a", "wait_share": 0.74},
                         {"rank": 2, "host": "b", "wait_share": 0.33}],
               "current": {"ranks": [2]}}
    assert node_waits(figures) == {"a": "r0 75%, r1 74%", "b": "r2 33% straggler"}
    assert node_waits(None) == {}


@pytest.mark.parametrize("wait", [0.4775, 0.4749, 0.45, 0.4725])
def test_the_line_and_the_json_agree_on_every_figure(wait) -> None:
    """A ratio of 2.2549 once read "2.3x" on the console and 2.25 (-> "2.2") in summary.json:
    each figure is rounded once, in the verdict."""
    figures = {0: fig(0, 0.7549), 1: fig(1, 0.7551), 2: fig(2, wait, starved=0.4)}
    verdict = find_straggler(figures, {}, DEFAULT_THRESHOLD)
    assert verdict is not None
    data = verdict.to_json()
    assert f"take {data['ratio']:.1f}x the median" in verdict.line()
    assert f"({data['others_wait_share']:.0%} of their time)" in verdict.line()
    assert f"wait {data['wait_per_collective_s']:.3f} s per collective" in verdict.line()


def _candidates_by_definition(figures: dict[int, RankFigures]) -> dict[tuple[int, ...], tuple]:
    """The rule as the module doc states it, the slow way: for each unit, the others' figures
    gathered and their medians taken afresh."""
    import statistics

    by_host: dict[str, list[int]] = {}
    for r, f in sorted(figures.items()):
        by_host.setdefault(f.host, []).append(r)
    units = [tuple(rs) for rs in by_host.values() if 1 < len(rs) < len(figures)]
    units += [(r,) for r in sorted(figures)]
    out = {}
    for ranks in units:
        others = [f for r, f in figures.items() if r not in ranks]
        median_wait = statistics.median(f.wait_share for f in others)
        if median_wait < 0.20:
            continue
        busy = min(figures[r].busy for r in ranks)
        ratio = round(busy / max(0.02, statistics.median(f.busy for f in others)), 2)
        counts = [f.collectives for f in others]
        per = None
        if all(c is not None and c > 0 for c in counts):
            per = max(0.0, sum(f.span - f.run - f.delay for f in others)) / sum(counts)
        out[ranks] = (ratio, round(median_wait, 3), per,
                      statistics.median(f.starved_share for f in others))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_quick_medians_give_the_rule_as_defined(seed) -> None:
    # 1024 nodes x 8 ranks took 45 s per evaluation when every unit sorted the other ranks;
    # the medians of "all but a unit" now come from one sort. Same verdicts, same figures.
    import random

    rnd = random.Random(seed)
    nodes = rnd.choice([3, 7, 40])
    figures = {}
    for r in range(nodes * rnd.choice([1, 2, 4])):
        wait = rnd.choice([0.1, 0.3, 0.5, 0.5, 0.7, rnd.random() * 0.9])  # (ties on purpose)
        collectives = rnd.choice([100, 100, 100, 3, None]) if seed % 2 else 100
        figures[r] = fig(r, wait, starved=rnd.choice([0.02, 0.05, 0.3]),
                         host=f"n{r % nodes}", collectives=collectives)
    want = _candidates_by_definition(figures)
    got = {v.ranks: v for v in candidates(figures, {})}
    assert set(got) == set(want)
    for ranks, (ratio, median_wait, per, usual) in want.items():
        v = got[ranks]
        assert (v.ratio, v.others_wait_share) == (ratio, median_wait), ranks
        assert (v.wait_per_collective is None) == (per is None), ranks
        if per is not None:
            assert v.wait_per_collective == pytest.approx(per, abs=1e-4), ranks
        saturated = "CPU is saturated" in v.why
        worst = max(figures[r].starved_share for r in ranks)
        assert saturated == (worst >= max(0.25, 1.5 * usual)), ranks
    for at_least in (1.0, 1.25, 1.5):  # (the units passed over could not have reached it)
        high = {v.ranks: v for v in candidates(figures, {}, at_least=at_least)}
        assert set(high) == {u for u, (ratio, *_) in want.items() if ratio >= at_least}
        assert all(high[u] == got[u] for u in high)


def test_a_straggler_among_8192_ranks_is_named() -> None:
    # 1024 nodes x 8 ranks, every rank waiting half of its time but one, which never waits.
    watch = StragglerWatch()
    body = {"span": 2.0, "run": 1.0, "delay": 0.02, "collectives": 5}
    slow = {"span": 2.0, "run": 1.98, "delay": 0.02, "collectives": 5}
    lines = []
    for k in range(6):
        for n in range(1024):
            watch.report(f"n{n}", {r: slow if r == 4242 else body
                                   for r in range(n * 8, n * 8 + 8)}, {})
        lines.append(watch.evaluate(1000.0 + 2 * k, set(range(8192))))
    named = [line for line in lines if line]
    assert len(named) == 1 and named[0].startswith("rank 4242 on n530 is the straggler"), lines
    assert watch.current is not None and watch.current.ratio == 1.96
    assert all(len(t["ratios"]) == 1 for t in watch.trace)  # (only ratios from release up)
