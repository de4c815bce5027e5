"""One exception root for everything a user can cause.

Every error names where it happened (a file and key path, or a node), what failed, and the fix.
The CLI turns a :class:`PtclusterError` into one red line and an exit code; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations


class PtclusterError(Exception):
    """Root of the errors a user can cause. ``exit_code`` is what the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(self.__str__())

    def __str__(self) -> str:
        return who_what_fix(None, self.message, self.fix)


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


def who_what_fix(who: str | None, what: str, fix: str | None) -> str:
    """The one shape of every problem we report: ``who: what. Fix: how``."""
    text = f"{who}: {what}" if who else what
    return f"{text}. Fix: {fix}" if fix else text
