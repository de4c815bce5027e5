"""One exception root for everything a user can cause.

Every error names where it happened (a file and key path, or a node), what failed, and the fix.
The CLI turns a :class:`PtclusterError` into one red line and an exit code; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


class PtclusterError(Exception):
    """Root of the errors a user can cause. ``exit_code`` is what the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(self.__str__())

    def __str__(self) -> str:
        return str(Problem(None, self.message, self.fix))


class UsageError(PtclusterError):
    """Bad command-line usage."""

    exit_code = 2


class SpecError(UsageError):
    """A bad cluster file, hostfile or ``--hosts`` value.

    ``source`` is the file (or ``--hosts``), ``path`` the key path inside it (``nodes[1].slots``).
    """

    def __init__(self, source: str, path: str, problem: str, fix: str | None = None) -> None:
        self.source = source
        self.path = path
        self.problem = problem
        where = f"{source}: {path}" if path else source
        super().__init__(f"{where}: {problem}", fix)


@dataclass(frozen=True)
class Problem:
    """One problem as every report says it: who (a node, a rank on a node; None: the command
    itself), what went wrong, and the fix (None: no fix to offer).

    Every failure, finding and refusal the user sees goes through this one type (torch elastic's
    ``ProcessFailure`` idea), so the console, ``summary.json``, doctor and setup say it the same
    way: ``str()`` is the one rendering. Pure (no I/O): the launch core may hold one.
    """

    who: str | None
    what: str
    fix: str | None = None

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
