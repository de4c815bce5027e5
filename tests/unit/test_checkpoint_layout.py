"""Which step a load or collect takes (``checkpoint.layout.choose``), from listings as the
nodes give them: only marked steps, only with every file somewhere, the marked holder and the
node's own part first; the marker's round trip; pruning."""

from __future__ import annotations

from pathlib import Path

import pytest

from ptcluster.checkpoint import layout
from ptcluster.checkpoint.layout import Holding, Manifest

M6 = Manifest(6, "s6", {0: {".metadata": [10, "a"], "__0_0.distcp": [100, "b"]},
                        1: {"__1_0.distcp": [100, "c"]}})
M4 = Manifest(4, "s4", {0: {".metadata": [10, "d"], "__0_0.distcp": [100, "e"]},
                        1: {"__1_0.distcp": [100, "f"]}})


def node0(step: int, marked: Manifest | None) -> Holding:
    return Holding(step, marked, {".metadata": [f"step-{step}/.metadata", 10],
                                  "__0_0.distcp": [f"step-{step}/__0_0.distcp", 100],
                                  "__1_0.distcp": [f"step-{step}/replica-of-1/__1_0.distcp",
                                                   100]})


def node1(step: int, marked: Manifest | None) -> Holding:
    return Holding(step, marked, {"__1_0.distcp": [f"step-{step}/__1_0.distcp", 100],
                                  ".metadata": [f"step-{step}/replica-of-0/.metadata", 10],
                                  "__0_0.distcp": [f"step-{step}/replica-of-0/__0_0.distcp",
                                                   100]})


def test_the_newest_marked_step_each_file_from_its_own_node_first() -> None:
    choice, why = layout.choose([[node0(6, M6), node0(4, M4)], [node1(6, M6), node1(4, M4)]])
    assert choice is not None and why == ""
    assert choice.manifest == M6
    assert choice.holders == {".metadata": [0, 1], "__0_0.distcp": [0, 1],
                              "__1_0.distcp": [1, 0]}


def test_an_unmarked_step_is_never_taken_even_when_newer_and_whole() -> None:
    choice, _ = layout.choose([[node0(8, None), node0(6, M6)], [node1(8, None), node1(6, M6)]])
    assert choice is not None and choice.manifest.step == 6


def test_a_step_marked_on_one_node_only_counts_and_unmarked_copies_serve_last() -> None:
    """A kill between two nodes' marker writes: the step is complete (every part and replica
    was written before any marker)."""
    choice, _ = layout.choose([[node0(6, M6)], [node1(6, None)]])
    assert choice is not None and choice.manifest.step == 6
    assert choice.holders["__1_0.distcp"] == [0, 1]


def test_a_step_with_a_file_on_no_node_falls_back_to_an_older_whole_one() -> None:
    lost = Holding(6, M6, {".metadata": ["step-6/.metadata", 10]})
    choice, _ = layout.choose([[lost, node0(4, M4)]])
    assert choice is not None and choice.manifest.step == 4


@pytest.mark.parametrize(("listings", "step", "said"), [
    ([[], []], None, "no node holds a complete checkpoint"),
    ([[node0(6, None)]], None, "no node holds a complete checkpoint"),
    ([[Holding(6, M6, {".metadata": ["step-6/.metadata", 10]})]], None,
     "step 6: 2 file(s) on no node now (__0_0.distcp ...)"),
    ([[node0(6, M6)], [node1(6, M6)]], 5,
     "no node holds a complete checkpoint of step 5 (have: 6)"),
    ([[Holding(6, M6, {**node0(6, M6).files, "__1_0.distcp": ["x", 99]})]], None,
     "step 6: 1 file(s) on no node now (__1_0.distcp ...)"),  # a wrong size does not count
])
def test_why_nothing_is_taken(listings, step, said) -> None:
    choice, why = layout.choose(listings, step)
    assert choice is None and why == said


def test_the_marker_round_trips_and_a_bad_one_is_no_marker() -> None:
    assert Manifest.parse(M6.to_bytes()) == M6
    for bad in (b"", b"{", b"[]", b'{"step": 1}', b'{"step": "x", "save_id": 1, "nodes": {}}'):
        assert Manifest.parse(bad) is None


def test_pruning_keeps_the_newest_complete_steps_and_drops_older_partial_ones(
        tmp_path: Path) -> None:
    for step, marked in ((2, True), (3, False), (4, True), (6, True), (7, False)):
        folder = layout.step_dir(tmp_path, step)
        folder.mkdir()
        if marked:
            layout.write_atomic(folder / layout.MARKER, Manifest(step, "x", {}).to_bytes())
    assert sorted(layout.prune(tmp_path, keep=2)) == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6", "step-7"]
    assert [h.step for h in layout.list_node(tmp_path)] == [7, 6, 4]
