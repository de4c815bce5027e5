"""Text that others wrote reaches the terminal harmless: no escape sequence of theirs is
written, no markup of theirs is parsed (``cli/console.py`` says how).

Two halves: ``clean`` and the writers that apply it, tried with what a hostile node or another
user's lease record may say; and the rule that keeps every command on those writers, read from
``cli/``'s source with ``ast`` (as ``test_protocol_strings`` reads frame kinds): a Rich console
is made only by ``terminal``, a line is printed only by ``say`` (or is JSON, or is listed in
``RAW`` with why), and a markup string interpolates nothing but escaped values.
"""

from __future__ import annotations

import ast
import io
import re
import time
from pathlib import Path

import pytest
from rich.console import Console

import ptcluster
from ptcluster.cli import _error_line, _traceback, doctor_cmd, monitor_cmd, ps_cmd, run_cmd
from ptcluster.cli.console import ConsoleFeed, clean, say, terminal
from ptcluster.doctor.checks import FAIL, OK, WARN, Finding
from ptcluster.doctor.diagnose import DoctorReport
from ptcluster.monitor.jobs import JobRow
from ptcluster.monitor.watch import NodeView

LINK = "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\\x1b[2K"
"""A hyperlink that shows "click" and opens evil.example, then an erase of the line."""
HOSTILE = f"{LINK} [/red] [link=https://x]y[/link]"
SGR = re.compile(r"\x1b\[[0-9;]*m")
"""Rich's own styles (colors, bold): the only escapes a rendering may hold."""


def written(draw) -> str:  # type: ignore[no-untyped-def]
    """What ``draw(console)`` writes on a color terminal made by ``terminal``."""
    out = io.StringIO()
    draw(terminal(file=out, force_terminal=True, color_system="standard", width=300))
    return out.getvalue()


def assert_harmless(text: str) -> None:
    """No escape but Rich's styles, no other control character; the hostile text shown as
    text (its link's words, its markup literally), its link target gone."""
    rest = SGR.sub("", text)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", rest), repr(rest)
    assert "click" in rest and "evil.example" not in rest
    assert "[/red]" in rest and "[link=https://x]y[/link]" in rest


@pytest.mark.parametrize("raw,shown", [
    ("plain text, [brackets] and ünïcode", "plain text, [brackets] and ünïcode"),
    (LINK, "click"),
    ("a\tb\nc", "a\tb\nc"),  # tab and newline stay: text of several lines
    ("over\rwrite", "over\ufffdwrite"),
    ("bell\x07 back\x08 del\x7f nul\x00", "bell\ufffd back\ufffd del\ufffd nul\ufffd"),
    ("\x1b[31mred\x1b[0m \x1b[1;2H\x1b[?25l", "red "),  # colors, cursor moves, hide cursor
    ("\x1b]0;a title\x07after", "after"),  # OSC ended by BEL
    ("\x1bP1$r0m\x1b\\dcs", "dcs"),  # DCS ended by ST
    ("\x9b2Jc1 csi \x9d8;;u\x9clink", "c1 csi link"),  # the same in C1
    ("\x1b]8;;https://never-ended", "8;;https://never-ended"),  # no terminator: shown
    ("ends with ESC\x1b", "ends with ESC\ufffd"),
    ("abc\u202edcba\u2066x", "abc\ufffddcba\ufffdx"),  # bidi overrides ("Trojan Source")
])
def test_clean(raw: str, shown: str) -> None:
    assert clean(raw) == shown
    assert clean(shown) == shown  # idempotent


def test_doctor_shows_a_nodes_text_as_text() -> None:
    """A GPU name, an OS name, a path: what a node said, in every place doctor shows it
    (before: `[/red]` crashed doctor and `run --preflight` with a MarkupError)."""
    report = DoctorReport(findings=[
        Finding.plain("gpu", "n1", FAIL, f"GPU {HOSTILE}", f"fix {HOSTILE}"),
        Finding.plain("versions", "n1", OK, f"torch {HOSTILE}"),
        Finding.plain("disk", "n1", WARN, HOSTILE)], probes={}, duration=1.0)
    out = written(lambda c: doctor_cmd.render(c, report, ["n1"]))
    assert_harmless(out)
    assert out.count("click") == 4 and SGR.sub("", out).splitlines()[-1] == \
        "1 check(s) failed (1.0 s)"


def test_ps_shows_another_users_record_as_text() -> None:
    row = JobRow(job_id=f"J{LINK}", user=f"nobody{LINK}", head=HOSTILE, command=HOSTILE,
                 started=time.time(), nodes=["n1"], ranks=1)
    assert_harmless(written(lambda c: c.print(ps_cmd.table([row]))))


def test_monitor_shows_a_nodes_sample_and_error_as_text() -> None:
    sample = {"cpu_percent": 1.0, "cpus": 4, "mem": {"used": 1e9, "total": 2e9},
              "net": {"rx_bps": 0.0, "tx_bps": 0.0},
              "jobs": {f"J{LINK}": {"user": HOSTILE, "ranks": 1}},
              "gpus": [{"index": 0, "name": HOSTILE, "util": 5, "mem_used": 0, "mem_total": 1e9,
                        "power_w": None, "temp_c": None}]}
    views = [NodeView("n1", sample=sample), NodeView("n2", error=f"unreachable: {HOSTILE}")]
    out = written(lambda c: c.print(monitor_cmd.table(views)))
    assert_harmless(out)
    assert out.count("click") == 4


@pytest.mark.parametrize("dry_run", [True, False])
def test_setup_shows_a_nodes_reasons_and_output_as_text(dry_run: bool) -> None:
    """A step's reason and a failed command's output are the node's (sudo's words, a path);
    before, `[/red]` in them crashed setup's report (``setup_cmd.py:129`` in the review)."""
    from ptcluster.cli import setup_cmd
    from ptcluster.setup import plan as P
    from ptcluster.setup import steps as S
    from ptcluster.setup.report import NodeSetupOutcome, SetupReport

    step = S.Step(P.STEPS[0], S.BLOCKED, HOSTILE)
    node = NodeSetupOutcome("n1", addr="10.0.0.1", connection="key", before=[step],
                            applied=[] if dry_run else [(P.STEPS[1], "failed", HOSTILE)])
    report = SetupReport({"n1": node}, head=[S.Step("venv", S.BLOCKED, HOSTILE)], torch=None,
                         dry_run=dry_run)
    out = written(lambda c: setup_cmd.render(c, report))
    assert_harmless(out)
    assert out.count("click") == (2 if dry_run else 3)


def test_runs_notes_are_cleaned_and_its_ranks_lines_are_not() -> None:
    """The status line the review saw: a lease record quoted in a refusal (``describe``)."""
    out: list[str] = []
    err: list[str] = []
    feed = ConsoleFeed(out.append, err.append)
    feed.note(f"ptcluster: stopping the job on every node: port 29500 is held by job x "
              f"(ops{LINK}, python train.py)")
    feed.line("\x1b[32mgreen\x1b[0m\r100%", "rank0.log")  # the user's own rank: as it is
    feed.close(timeout=5.0)
    assert "".join(err) == "ptcluster: stopping the job on every node: port 29500 is held by " \
                           "job x (opsclick, python train.py)\n"
    assert "".join(out) == "\x1b[32mgreen\x1b[0m\r100%\n"


def test_runs_node_lines_are_cleaned_and_its_ranks_lines_are_not(tmp_path: Path) -> None:
    """A node's own line (its program's stderr: ssh's, a login banner's, torchrun's) is the
    node's words; a rank's line is the user's."""
    out: list[str] = []
    feed = ConsoleFeed(out.append, out.append)
    on_line = run_cmd.line_sink(feed, tmp_path)
    on_line("n1", None, f"Warning: {HOSTILE}")
    on_line("n1", 0, "\x1b[32mgreen\x1b[0m")
    feed.close(timeout=5.0)
    assert "".join(out) == "[n1] Warning: click [/red] [link=https://x]y[/link]\n" \
                           "[n1:0] \x1b[32mgreen\x1b[0m\n"


def test_the_error_line_a_traceback_and_say_are_cleaned(capsys: pytest.CaptureFixture[str]) -> None:
    _error_line(f"gpu 0 is held by job {HOSTILE}", f"wait for {LINK}")
    assert capsys.readouterr().err == "error: gpu 0 is held by job click [/red] " \
                                      "[link=https://x]y[/link]. Fix: wait for click\n"
    _traceback(ValueError(f"bad record {LINK}"))  # (a bug, or -v; never raised: no frames)
    assert capsys.readouterr().err == "ValueError: bad record click\n"
    say(f"ptcluster: job J: refused on n1: {HOSTILE}", err=True)  # (kill's lines)
    assert capsys.readouterr().err == "ptcluster: job J: refused on n1: click [/red] " \
                                      "[link=https://x]y[/link]\n"


def test_a_terminal_keeps_its_own_cursor_moves() -> None:
    """Rich's control segments (a live table redrawn in place) are not text: they stay."""
    from rich.control import Control

    out = io.StringIO()
    terminal(file=out, force_terminal=True).print(Control.move_to_column(0), "x")
    assert "\x1b[1G" in out.getvalue()


# -- the rule, from the source ----------------------------------------------------------------

CLI = Path(ptcluster.__file__).parent / "cli"
WRITERS = "console.py"
"""The module of the writers: the only one that may make a console or write a line itself."""
RAW = {
    "env_cmd.py": "shell code for `eval`: cleaning would change the values; quoting them "
                  "(control characters too) is its own rule",
    "init_cmd.py": "the cluster file it renders from the user's answers, and their mistakes",
    "submit_cmd.py": "the sbatch script it renders (--dry-run) from the user's own arguments",
    "__init__.py": "the error line and the log handler: they clean what they write",
    "run_cmd.py:_fd_writer": "run's ConsoleFeed writes through it: the feed cleans its notes, "
                             "a rank's lines go out as the rank wrote them",
    "run_cmd.py:_stdout_writer": "the same writer, and one line of ours",
}
"""Modules (or functions, ``file:function``) that may write a line not through ``say``, and
why what they write is safe."""
PRINTS = {"echo", "secho", "print", "write"}
"""Calls that write a line: ``click.echo``, ``print``, ``sys.stderr.write``, ``os.write``...
and a Rich console's ``print``, allowed on a console of ``terminal``'s."""
CONSOLES = {"console", "err", "out", "live"}
"""The names ``cli/`` holds its ``terminal()`` consoles by (a parameter ``console: Console``
is always one: ``test_consoles_are_made_by_terminal_only``)."""


def _calls() -> list[tuple[str, ast.Call]]:
    """Every call in ``cli/``, with where it is: ``file`` or ``file:function``."""
    found = []
    for path in sorted(CLI.glob("*.py")):
        def visit(node: ast.AST, where: str) -> None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ":" not in where:
                where = f"{where}:{node.name}"
            if isinstance(node, ast.Call):
                found.append((where, node))
            for child in ast.iter_child_nodes(node):
                visit(child, where)
        visit(ast.parse(path.read_text()), path.name)
    return found


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else \
        func.id if isinstance(func, ast.Name) else ""


def _json(node: ast.expr) -> bool:
    """``json.dumps(...)``: control characters come out as ``\\uXXXX``."""
    return isinstance(node, ast.Call) and _name(node.func) == "dumps"


def _safe_markup(node: ast.expr) -> bool:
    """A markup string of ours: a literal, or an f-string whose every value is escaped or a
    number formatted as one (``{x:.1f}``, ``{n:d}``)."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.JoinedStr):
        return all(isinstance(v, ast.Constant) or (
            isinstance(v, ast.FormattedValue) and (
                v.format_spec is not None and v.conversion == -1
                or isinstance(v.value, ast.Call) and _name(v.value.func) == "escape"))
            for v in node.values)
    return False


def test_consoles_are_made_by_terminal_only() -> None:
    """A Rich console made elsewhere would write others' escapes and parse their markup;
    a ``Live`` without one makes Rich's global console."""
    bad = [f"{f}:{c.lineno}" for f, c in _calls() if f.split(":")[0] != WRITERS and (
        _name(c.func) == "Console"
        or _name(c.func) == "terminal" and any(k.arg == "markup" for k in c.keywords)
        or _name(c.func) == "Live" and not any(k.arg == "console" for k in c.keywords))]
    assert not bad, f"make consoles with cli.console.terminal() (no markup): {bad}"


def test_lines_are_printed_by_say_only() -> None:
    bad = [f"{f}:{c.lineno}" for f, c in _calls()
           if _name(c.func) in PRINTS and f.split(":")[0] != WRITERS
           and f not in RAW and f.split(":")[0] not in RAW
           and not (isinstance(c.func, ast.Attribute) and _name(c.func) == "print" and (
               _name(c.func.value) in CONSOLES or isinstance(c.func.value, ast.Call)
               and _name(c.func.value.func) == "terminal"))
           and not (c.args and _json(c.args[0]))]
    assert not bad, f"print lines with cli.console.say() (it cleans them): {bad}"


def test_markup_interpolates_only_escaped_values() -> None:
    bad = [f"{f}:{c.lineno}" for f, c in _calls()
           if any(k.arg == "markup" and isinstance(k.value, ast.Constant) and k.value.value
                  for k in c.keywords)
           and not all(_safe_markup(a) for a in c.args)]
    assert not bad, ("markup=True with a value not escaped: escape(...) it, or print a "
                     f"rich.text.Text: {bad}")


def test_the_rule_finds_what_it_forbids() -> None:
    """The checks above are not empty: the old code's shapes are caught."""
    tree = ast.parse('Console(stderr=True)\n'
                     'console.print(f"  {STYLE[s]} {f.check}: {f.line()}", markup=True)\n')
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert _name(calls[0].func) == "Console"
    markup = next(c for c in calls if any(k.arg == "markup" for k in c.keywords))
    assert not all(_safe_markup(a) for a in markup.args)
    assert _safe_markup(ast.parse('f"[dim]{escape(h)}: {n:d} {t:.1f}[/dim]"').body[0].value)


def test_rich_itself_passes_escapes() -> None:
    """Why the writers clean: a plain Rich console writes ESC as it gets it (the review saw
    ``ps`` do so). If Rich ever strips them, ``clean`` is belt and braces."""
    out = io.StringIO()
    Console(file=out, force_terminal=True, markup=False, highlight=False).print(LINK)
    assert "\x1b]8;;https://evil.example/" in out.getvalue()
