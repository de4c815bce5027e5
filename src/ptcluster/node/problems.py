"""What can go wrong, declared as data: one entry per problem, with a stable code.

A :class:`Declared` entry is a problem's code (``doctor.shm-small``), a short title, and its
*what* and *fix* as text with ``{named}`` placeholders. Code that finds the problem gives the
values by name (``SHM_SMALL.texts(total="0.06")``); the entry's text says it. A value missing or
one too many is an error (``TypeError``), and a unit test fills every entry of every table with
exactly its fields, so text and call sites cannot drift apart. The docs' pages are generated
from the tables (``scripts/docs_reference.py``), never from the code that finds the problems.

Codes are dotted names: ``KIND.NAME``, where KIND says who reports it (``doctor``, ``health``,
``guard``, ``node``) and NAME is kebab-case words. A code is a contract (``summary.json``,
``doctor --json``, tests and scripts key on it): never reuse one for another meaning; a
rewording of the text keeps its code.

Standard library only: the node's programs (the health gate, the guard's refusals) declare
their tables here too, and send the code in their frames beside the text.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypedDict

CODE = re.compile(r"^[a-z]+\.[a-z0-9]+(-[a-z0-9]+)*$")
"""What a code looks like: ``KIND.NAME``, lower case, NAME's words joined by ``-``."""


def placeholders(text: str) -> frozenset[str]:
    """The ``{named}`` fields of ``text`` (a format spec after the name is allowed)."""
    return frozenset(name for _, name, _, _ in string.Formatter().parse(text) if name)


class Sent(TypedDict):
    """A declared problem as a node's program sends it (:meth:`Declared.sent`), read on the head
    by ``errors.Problem.received``."""

    code: str
    what: str
    fix: str
    fields: dict[str, str]
    """The values it was said with, as text."""


@dataclass(frozen=True)
class Declared:
    """One problem as declared data: its code, a title, and what went wrong and the fix, with
    ``{named}`` placeholders filled from the values the finder gives by name."""

    code: str
    title: str
    what: str
    fix: str

    @property
    def fields(self) -> frozenset[str]:
        """Every value this entry needs: the placeholders of its what and its fix."""
        return placeholders(self.what) | placeholders(self.fix)

    def texts(self, **values: object) -> tuple[str, str]:
        """(what, fix) with ``values`` filled in; ``TypeError`` when a field is missing or a
        value is given that no placeholder uses."""
        given = set(values)
        if given != self.fields:
            raise TypeError(f"{self.code}: missing {sorted(self.fields - given)}, "
                            f"extra {sorted(given - self.fields)}")
        return self.what.format(**values), self.fix.format(**values)

    def sent(self, **values: object) -> Sent:
        """The problem as a node's program sends it: ``{code, what, fix, fields}`` (the values
        as strings; ``errors.Problem.received`` reads it on the head)."""
        what, fix = self.texts(**values)
        return {"code": self.code, "what": what, "fix": fix,
                "fields": {k: str(v) for k, v in values.items()}}


def lint(entries: Iterable[Declared]) -> list[str]:
    """What is wrong with a table's entries (the unit test's check): a malformed or repeated
    code, an empty title or fix, a fix that is only a placeholder."""
    seen: set[str] = set()
    bad = []
    for e in entries:
        if not CODE.match(e.code):
            bad.append(f"{e.code}: not KIND.NAME")
        if e.code in seen:
            bad.append(f"{e.code}: given twice")
        seen.add(e.code)
        if not e.title.strip() or not e.what.strip():
            bad.append(f"{e.code}: no title or what")
        if not e.fix.format(**{f: "" for f in e.fields}).strip():
            bad.append(f"{e.code}: no fix of its own")
    return bad
