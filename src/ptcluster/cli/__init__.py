"""The ``ptcluster`` command: parse, call the library, render, choose the exit code."""

from __future__ import annotations

import errno
import gc
import importlib
import logging
import os
import sys
import traceback
from collections.abc import MutableMapping, Sequence
from typing import NoReturn

import click

from ptcluster import __version__
from ptcluster.cli.common import CliState
from ptcluster.cli.console import clean
from ptcluster.errors import PtclusterError

log = logging.getLogger("ptcluster")

# click >= 8.2 raises this for a bare `ptcluster` (older versions print the help themselves)
_NO_ARGS_IS_HELP: tuple[type[click.UsageError], ...] = tuple(
    t for t in [getattr(click.exceptions, "NoArgsIsHelpError", None)] if t is not None)


SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Set up", ("init", "setup", "doctor")),
    ("Run", ("run", "ps", "kill", "warm", "stacks", "sync", "push", "collect", "submit")),
    ("Observe", ("monitor", "bench")),
    ("Inspect", ("env", "venvs")),
)
"""The commands in the order a user meets them, grouped: ``--help`` and the docs' command
reference both list them so (click lists a group's commands alphabetically by default)."""
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run_cmd", "run"), "env": ("env_cmd", "env"), "init": ("init_cmd", "init"),
    "doctor": ("doctor_cmd", "doctor"), "bench": ("bench_cmd", "bench"),
    "monitor": ("monitor_cmd", "monitor"), "submit": ("submit_cmd", "submit_job"),
    "setup": ("setup_cmd", "setup"), "sync": ("sync_cmd", "sync"),
    "stacks": ("stacks_cmd", "stacks"), "ps": ("ps_cmd", "ps"), "kill": ("kill_cmd", "kill"),
    "push": ("push_cmd", "push_cmd"), "collect": ("collect_cmd", "collect"),
    "venvs": ("venvs_cmd", "venvs"), "warm": ("warm_cmd", "warm"),
}
"""Each command's module in ``ptcluster.cli`` and its name there. A command's module is imported
when that command runs (or when the help lists them all), not for every command: ``run``
imported ``monitor --serve``'s Prometheus client, ``setup``'s wheels and ``bench``'s sweeps
before its first node started (~40 % of the head's start-up CPU: ``benchmarks/launch_overhead``)."""


class SectionedGroup(click.Group):
    """A group whose help lists its commands by :data:`SECTIONS`, not alphabetically, and whose
    commands are imported when first asked for (:data:`COMMANDS`)."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, attr = COMMANDS[cmd_name]
            cmd = getattr(importlib.import_module(f"ptcluster.cli.{module}"), attr)
            assert cmd.name == cmd_name, (cmd.name, cmd_name)
            self.add_command(cmd)
        return super().get_command(ctx, cmd_name)

    def load_all(self) -> MutableMapping[str, click.Command]:
        """Every command, imported (the help, the docs' reference): ``self.commands``."""
        for name in COMMANDS:
            self.get_command(click.Context(self), name)
        return self.commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        ordered = [name for _, names in SECTIONS for name in names]
        # a command missing from SECTIONS still shows (last), never silently hidden
        return ordered + sorted((set(self.commands) | set(COMMANDS)) - set(ordered))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self.load_all()
        limit = formatter.width - 6 - max(len(n) for n in self.commands)
        listed = set()
        for title, names in (*SECTIONS, ("Other", tuple(self.list_commands(ctx)))):
            rows = []
            for name in names:
                cmd = self.commands.get(name)
                if cmd is None or cmd.hidden or name in listed:
                    continue
                listed.add(name)
                rows.append((name, cmd.get_short_help_str(limit)))
            if rows:
                with formatter.section(f"Commands ({title.lower()})"):
                    formatter.write_dl(rows)


@click.group(cls=SectionedGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ptcluster")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug); tracebacks "
              "for errors.")
@click.option("-q", "--quiet", is_flag=True, help="Only errors and the command's data.")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: bool) -> None:
    """Turn a few machines into a working PyTorch DDP cluster: set up, check, run, bench, watch."""
    state = ctx.ensure_object(CliState)
    state.verbose, state.quiet = verbose, quiet
    configure_logging(verbose, quiet)


def all_commands() -> MutableMapping[str, click.Command]:
    """Every command of the app, imported (the docs' reference, the tests of every command)."""
    assert isinstance(cli, SectionedGroup)
    return cli.load_all()



class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is when a record arrives (not when it was created)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(clean(self.format(record)) + "\n")
        except Exception:  # logging must never take the command down
            self.handleError(record)


def configure_logging(verbose: int, quiet: bool) -> None:
    """-q: errors only; default: warnings; -v: info; -vv: debug. Applies to ``ptcluster.*``."""
    level = (logging.DEBUG if verbose > 1 else logging.INFO if verbose else
             logging.ERROR if quiet else logging.WARNING)
    log.setLevel(level)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
    log.propagate = False  # our handler prints it; a root handler would print it twice


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point (the console script's): every expected error becomes one red line
    ``error: WHAT. Fix: HOW`` and its exit code; the traceback only with -v. The exit is
    raised from that error (``SystemExit.__cause__``: its problem, with its code, for a
    caller in this process)."""
    state = CliState()
    raise_open_files_limit()
    code = _dispatch(list(sys.argv[1:] if argv is None else argv), state)
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = _stdout_gone()
    if argv is None:  # (the command's own process, which ends now)
        # the interpreter's last collections then pass over what the ~400 modules made: every
        # command's exit took ~20 ms more (a run's last line to its exit, 29 ms)
        gc.freeze()
    raise SystemExit(code) from state.error


def raise_open_files_limit() -> tuple[int, int]:
    """The soft limit of open files up to the hard one, as servers do at start: the head holds
    a channel's pipes and a log per rank for every node (Ubuntu's default soft limit, 1024, is
    what a login gets even where the hard limit is far higher). Returns the (soft, hard) now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # (a kernel maximum below the hard limit: keep ours)
            pass
    return soft, hard


def _dispatch(args: list[str], state: CliState) -> int:
    try:
        rv = cli.main(args=args, prog_name="ptcluster", standalone_mode=False, obj=state)
        return rv if isinstance(rv, int) else 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        _error_line(str(exc.code), None)
        return 1
    except BrokenPipeError:
        return _stdout_gone()
    except PtclusterError as exc:
        state.error = exc
        _report(exc, state, exc.message, exc.fix)
        return exc.exit_code
    except click.exceptions.Abort:  # Ctrl-C at a prompt, or EOF on it
        return 130
    except KeyboardInterrupt:
        return 130
    except _NO_ARGS_IS_HELP as exc:  # bare `ptcluster` (click >= 8.2): the help, as click does
        exc.show()
        return exc.exit_code
    except click.UsageError as exc:  # exit 2: bad option, value, command or argument
        _report(exc, state, exc.format_message(), _help_fix(exc.ctx))
        return exc.exit_code
    except click.ClickException as exc:
        _report(exc, state, exc.format_message(), "see ptcluster -h")
        return exc.exit_code
    except OSError as exc:
        _report(exc, state, *_describe_os_error(exc))
        return 1
    except Exception as exc:  # a bug: say so, and keep the traceback
        _error_line(f"ptcluster hit a bug: {type(exc).__name__}: {exc}",
                    "please report it with the traceback below")
        _traceback(exc)
        return 1


def _report(exc: BaseException, state: CliState, message: str, fix: str | None) -> None:
    if state.verbose:
        _traceback(exc)
    _error_line(message, fix)


def _error_line(message: str, fix: str | None) -> None:
    text = " ".join(clean(message).split())  # (a refusal may quote a node or a lease record)
    if fix and "Fix:" not in text:
        text = f"{text.rstrip('.')}. Fix: {' '.join(clean(fix).split())}"
    click.echo(f"{click.style('error:', fg='red', bold=True)} {text}", err=True)


def _traceback(exc: BaseException) -> None:
    """The traceback (a bug, or -v), cleaned: its messages may quote a node or a record."""
    sys.stderr.write(clean("".join(traceback.format_exception(exc))))


def _help_fix(ctx: click.Context | None) -> str:
    path = ctx.command_path if ctx is not None else "ptcluster"
    return f"see `{path} -h`"


_OS_FIXES = {
    errno.ENOENT: "check the path; its folder must exist",
    errno.EACCES: "check the permissions, or use another path",
    errno.EPERM: "check the permissions, or use another path",
    errno.EROFS: "use a path on a writable file system",
    errno.ENOSPC: "free some disk space, or use another path",
    errno.EISDIR: "give a file, not a folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder: fix the path",
    errno.EEXIST: "remove it, or use another path",
}


def _describe_os_error(exc: OSError) -> tuple[str, str]:
    what = exc.strerror or str(exc) or type(exc).__name__
    message = f"{exc.filename}: {what}" if exc.filename is not None else what
    if exc.filename2 is not None:
        message += f" (and {exc.filename2})"
    fix = _OS_FIXES.get(exc.errno or 0, "check the path and try again (-v shows the details)")
    return message, fix


def _stdout_gone() -> int:
    """The reader of our stdout went away (``ptcluster env | head -1``): stop quietly.

    As the Python docs recommend, point stdout at /dev/null so the interpreter's final flush
    does not raise again at exit.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (e.g. captured in a test)
        pass
    return 1
