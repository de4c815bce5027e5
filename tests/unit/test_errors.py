"""``Problem`` is the one shape of every problem we report: ``who: what. Fix: how``."""

from __future__ import annotations

import dataclasses

import pytest

from ptcluster.errors import Problem, PtclusterError, who_what_fix


@pytest.mark.parametrize(("who", "what", "fix", "text"), [
    ("node1", "no answer", "check ssh", "node1: no answer. Fix: check ssh"),
    (None, "no answer", "check ssh", "no answer. Fix: check ssh"),
    ("node1", "no answer", None, "node1: no answer"),
    (None, "no answer", None, "no answer"),
])
def test_problem_renders_who_what_fix(who: str | None, what: str, fix: str | None,
                                      text: str) -> None:
    assert str(Problem(who, what, fix)) == text == who_what_fix(who, what, fix)


def test_problem_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Problem("a", "b").what = "c"  # type: ignore[misc]


def test_error_says_it_as_a_problem() -> None:
    assert str(PtclusterError("bad", "do this")) == "bad. Fix: do this"


def test_by_names_who_says_it() -> None:
    said = Problem(None, "refused", "ask")
    assert str(said.by("node2")) == "node2: refused. Fix: ask" and said.who is None
