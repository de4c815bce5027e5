"""One exception root for everything a user can cause.

Every error names where it happened (a file and key path, or a node), what failed, and the fix.
The CLI turns a :class:`PtclusterError` into one red line and an exit code; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ptcluster.node.problems import Declared


class PtclusterError(Exception):
    """Root of the errors a user can cause. ``exit_code`` is what the CLI exits with.

    It embeds one :class:`Problem` (``problem``; who None: the command itself); ``message``
    and ``fix`` are its what and fix."""

    exit_code = 1

    def __init__(self, message: str, fix: str | None = None, code: str | None = None) -> None:
        self.problem = Problem(None, message, fix, code)
        super().__init__(self.__str__())

    @classmethod
    def of(cls, entry: Declared, **values: object) -> PtclusterError:
        """The error a declared problem is, its fields filled in by name (``problem.fields``
        keeps them)."""
        what, fix = entry.texts(**values)
        err = cls(what, fix, entry.code)
        err.problem = Problem.of(entry, None, **values)
        return err

    @property
    def message(self) -> str:
        return self.problem.what

    @property
    def fix(self) -> str | None:
        return self.problem.fix

    @property
    def code(self) -> str | None:
        return self.problem.code

    def __str__(self) -> str:
        return str(self.problem)


class UsageError(PtclusterError):
    """Bad command-line usage."""

    exit_code = 2


class SpecError(UsageError):
    """A bad cluster file, hostfile or ``--hosts`` value.

    ``source`` is the file (or ``--hosts``), ``path`` the key path inside it (``nodes[1].slots``),
    ``detail`` what is wrong there (its ``problem``'s what is all three together).
    """

    def __init__(self, source: str, path: str, problem: str, fix: str | None = None) -> None:
        self.source = source
        self.path = path
        self.detail = problem
        where = f"{source}: {path}" if path else source
        super().__init__(f"{where}: {problem}", fix)


@dataclass(frozen=True)
class Problem:
    """One problem as every report says it: who (a node, a rank on a node; None: the command
    itself), what went wrong, and the fix (None: no fix to offer).

    A declared one carries its ``code`` (``node.problems``: a table of them for each kind).
    Every failure, finding and refusal the user sees goes through this one type (torch elastic's
    ``ProcessFailure`` idea), so the console, ``summary.json``, doctor and setup say it the same
    way: ``str()`` is the one rendering. Pure (no I/O): the launch core may hold one.
    """

    who: str | None
    what: str
    fix: str | None = None
    code: str | None = None
    """The declared problem this is (``node.problems``: ``doctor.shm-small``); None for one
    said in words only."""
    values: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    """The named values its entry's text was filled with (``(("total", "0.06"),)``): what
    ``summary.json``, ``doctor --json`` and tests read, never the sentence."""

    @classmethod
    def of(cls, entry: Declared, who: str | None, /, **values: object) -> Problem:
        """The problem ``entry`` declares, said by ``who``, its fields filled in by name
        (``TypeError`` for a field missing or one too many)."""
        what, fix = entry.texts(**values)
        return cls(who, what, fix, entry.code, tuple((k, str(v)) for k, v in values.items()))

    @classmethod
    def received(cls, who: str | None, sent: Mapping[str, Any]) -> Problem:
        """A node's problem as its program sent it (``Declared.sent``: ``{what, fix, code,
        fields}``; a code or fields missing: one said in words), said by ``who``."""
        fields = sent.get("fields") or {}
        return cls(who, str(sent["what"]), sent.get("fix") or None, sent.get("code"),
                   tuple((str(k), str(v)) for k, v in fields.items()))

    @property
    def fields(self) -> dict[str, str]:
        """``values`` as a table."""
        return dict(self.values)

    def by(self, who: str | None) -> Problem:
        """The same problem said by ``who``: a part that knows only what went wrong leaves who
        to its caller (the node it was asked about)."""
        return replace(self, who=who)

    def __str__(self) -> str:
        """The one shape of every problem we report: ``who: what. Fix: how``."""
        text = f"{self.who}: {self.what}" if self.who else self.what
        return f"{text}. Fix: {self.fix}" if self.fix else text


def who_what_fix(who: str | None, what: str, fix: str | None) -> str:
    """``str(Problem(who, what, fix))``, for a caller that holds the three parts loose."""
    return str(Problem(who, what, fix))


def some(names: list[str], shown: int = 3, sep: str = ", ") -> str:
    """``a, b, c +97 more``: many nodes (or ranks) named in one line, so that a problem on 1024
    nodes stays a line."""
    return sep.join(names[:shown]) + (f" +{len(names) - shown} more" if len(names) > shown
                                      else "")
