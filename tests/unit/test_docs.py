"""The docs cannot drift: every command option and cluster-file key is documented, the generated
reference renders, and every shell block of the pages a user follows either runs
(tests/local/test_docs_site.py runs them, and builds the site) or says why it cannot."""

from __future__ import annotations

import re

import click
import pytest
import yaml

from ptcluster.cli import SECTIONS, all_commands, cli
from ptcluster.cli.exits import EXIT_CODES
from ptcluster.cluster.keys import KEYS, keys_at
from ptcluster.cluster.load import spec_from_data
from scripts import docs_reference as ref
from tests.support.docblocks import SHELL, blocks, user_pages


def test_every_command_is_in_one_help_section() -> None:
    listed = [name for _, names in SECTIONS for name in names]
    assert sorted(listed) == sorted(all_commands()), "a command missing from (or extra in) SECTIONS"
    assert len(listed) == len(set(listed))


@pytest.mark.parametrize("name", sorted(all_commands()))
def test_every_command_and_option_has_documentation(name: str) -> None:
    cmd = all_commands()[name]
    assert (cmd.help or "").strip(), f"`ptcluster {name}` has no help text"
    page = ref.commands_page()
    assert f"### ptcluster {name}\n" in page
    section = page.split(f"### ptcluster {name}\n")[1].split("\n### ")[0]
    for param in cmd.params:
        if isinstance(param, click.Option) and not param.hidden:
            assert (param.help or "").strip(), f"ptcluster {name} {param.opts[0]}: no help text"
            for opt in param.opts:
                assert opt in section, f"ptcluster {name} {opt} is not on the commands page"


def test_rendering_the_commands_page_leaves_the_app_as_it_was() -> None:
    """click caches a command's help option from the first context that asks: the page must
    ask with the app's own settings (``-h`` beside ``--help``), in the page and after it."""
    page = ref.commands_page()
    sections = page.split("\n## ptcluster\n")[1].split("\n### ")
    lasts = [[line for line in section.splitlines() if line.startswith("| `")][-1]
             for section in sections]  # (every command's options, the app's own first)
    assert len(lasts) == len(all_commands()) + 1
    assert {last.split(" | ")[0] for last in lasts} == {"| `-h, --help`"}, lasts
    with cli.make_context("ptcluster", ["env", "-h"], resilient_parsing=True) as ctx:
        env = all_commands()["env"]
        assert env.get_help_option(ctx) is not None
        assert "-h" in env.get_help_option(ctx).opts  # type: ignore[union-attr]


def test_the_commands_page_is_in_help_order() -> None:
    page = ref.commands_page()
    order = [m.group(1) for m in re.finditer(r"^### ptcluster (\w+)$", page, re.M)]
    assert order == [n for _, names in SECTIONS for n in names]


def test_every_cluster_file_key_is_documented_with_a_valid_example() -> None:
    page = ref.cluster_file_page()
    for k in KEYS:
        assert k.type and k.default and k.example and k.doc, k.path
        assert f"| `{k.path}` |" in page, k.path
        example = yaml.safe_load(k.example)
        assert isinstance(example, dict) and list(example) == [k.name], \
            f"{k.path}: its example {k.example!r} does not set {k.name}"
    # the loader reads its keys from the same table: nothing it accepts goes undocumented
    for level in ("", "nodes[]", "master", "ssh", "nodes[].ssh"):
        assert keys_at(level), level


def test_a_cluster_file_made_of_every_documented_example_loads() -> None:
    """Every example on the page is a value the loader accepts, all of them at once."""
    def examples(level: str) -> dict[str, object]:
        out: dict[str, object] = {}
        for k in KEYS:
            if k.level == level:
                out.update(yaml.safe_load(k.example))
        return out

    node = examples("nodes[]")
    node["ssh"] = examples("nodes[].ssh")
    data = examples("")
    data.update(nodes=[node, "node2:1"], master=examples("master"), ssh=examples("ssh"))
    spec = spec_from_data(data, "every-example.yaml", trusted=True)
    assert [n.host for n in spec.nodes] == [node["host"], "node2"]
    assert spec.nodes[0].ssh.user == examples("nodes[].ssh")["user"]


def test_summary_json_fields_are_all_described() -> None:
    fields = set(ref.sample_summary())
    assert fields == set(ref.SUMMARY_FIELDS), (
        "summary.json has fields without a description in scripts/docs_reference.py (or the "
        "reverse): "
        f"{sorted(fields ^ set(ref.SUMMARY_FIELDS))}")
    assert all(text.strip() for text in ref.SUMMARY_FIELDS.values())


def test_exit_codes_are_one_table() -> None:
    codes = [code for code, _ in EXIT_CODES]
    assert len(codes) == len(set(codes)) and {0, 1, 2, 3, 4, 130, 143} <= set(codes)
    page = ref.exit_codes_page()
    assert all(f"| {code} |" in page for code in codes)


def test_the_rank_environment_page_is_the_plan() -> None:
    page = ref.render("reference/rank-environment.md")
    for name, node1 in (("WORLD_SIZE", "4"), ("NODE_RANK", "1"), ("LOCAL_WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "head")):
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        assert row.split(" | ")[2] == node1, row


def test_every_doctor_check_and_declared_problem_is_on_its_page() -> None:
    from ptcluster.doctor.checks import FAST_CHECKS

    page = ref.doctor_checks_page()
    for check in FAST_CHECKS:  # every check is on the page, described where it says what it does
        assert f"| {check.__name__.removeprefix('check_').replace('_', ' ')} |" in page
    for entry in declared():  # every problem of every table: its code, text and fix
        row = next((line for line in page.splitlines() if f"| `{entry.code}` |" in line), None)
        assert row is not None, entry.code
        assert f"| {ref._cell(ref.template(entry.fix))} |" in row, row
    # a field is shown as a field, never as a format string
    shm = next(line for line in page.splitlines() if "`doctor.shm-small`" in line)
    assert "‹total›" in shm and "{" not in shm


def declared() -> list:
    from ptcluster.doctor.findings import TABLE
    from ptcluster.node.facts.health import REFUSALS, WARNINGS
    from ptcluster.node.guard.refusal import TABLE as GUARD
    from ptcluster.remote.diagnoses import TABLE as NODE
    from ptcluster.venvs.problems import TABLE as VENVS

    return [*TABLE, *NODE, *REFUSALS, *WARNINGS, *GUARD, *VENVS]


def test_the_command_lines_refusals_are_on_the_exit_codes_page() -> None:
    from ptcluster.checkpoint.collect import TABLE as CHECKPOINT
    from ptcluster.cli.problems import TABLE as CLI
    from ptcluster.node.blobs import TABLE as FILE
    from ptcluster.node.data_agent import TABLE as NODE_PUSH
    from ptcluster.push.scan import TABLE as PUSH
    from ptcluster.remote.slurm import TABLE as SLURM
    from ptcluster.submit.sbatch import TABLE as SUBMIT

    page = ref.render("reference/exit-codes.md")
    assert all(f"| `{e.code}` | {ref._cell(e.title)} |" in page
               for e in CLI + SUBMIT + SLURM + CHECKPOINT + PUSH + NODE_PUSH + FILE)


def test_the_docs_generator_reads_tables_not_code() -> None:
    """The reference is rendered from objects (tables, the click app, docstrings), never by
    parsing a function's body: a refactor of a check cannot change its docs."""
    from pathlib import Path

    source = Path(ref.__file__).read_text()
    assert "import ast" not in source and "getsource" not in source


def test_a_table_cell_escapes_pipes_outside_code_spans_only() -> None:
    """A pipe splits a row unless escaped, but inside backticks Python-Markdown keeps it (and
    would show the backslash): ``ps aux --sort=-rss | head`` read ``ps aux … \\| head``."""
    assert ref._cell("see `ps aux | head` | or `a|b`") == "see `ps aux | head` \\| or `a|b`"
    assert ref._cell("``ended by `k` | x`` |  y") == "``ended by `k` | x`` \\| y"
    assert ref._cell("a | b\n c") == "a \\| b c"


def test_the_known_failures_page_is_the_table() -> None:
    from ptcluster.launch.problems import TABLE as RUN
    from ptcluster.launch.supervise.known import TABLE

    page = ref.render("troubleshooting/known-failures.md")
    assert all(f"(`{k.name}`)" in page for k in TABLE)
    assert all(f"| `{e.code}` | {ref._cell(e.title)} |" in page for e in RUN)


def test_every_shell_block_runs_or_says_why_not() -> None:
    found = [b for page in user_pages() for b in blocks(page)]
    assert len(found) >= 10 and any(b.page == "getting-started.md" and b.not_run is None
                                    for b in found)
    for b in found:
        assert b.lang in SHELL
        if b.not_run is not None:
            assert len(b.not_run) >= 10, f"{b.id}: a not-run marker needs its reason"


def test_the_readme_is_a_front_page_whose_links_exist() -> None:
    """README.md links into the docs (relative paths a repository page resolves) and names the
    one command that builds and serves the site."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)\)", readme)
    assert len(links) >= 10
    missing = [link for link in links if not link.startswith("http") and
               not (root / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    shell = {line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", readme, re.S)
             for line in block.splitlines()}  # (the commands of its shell blocks)
    assert {".venv/bin/mkdocs serve", "bash scripts/test.sh"} <= shell, shell


def test_a_block_that_only_writes_files_is_known_as_such(tmp_path, monkeypatch) -> None:
    """The testbed's blocks may use a script an earlier block of their page wrote: only blocks
    that write files and nothing else are run before them."""
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text("```bash\ncat > a.py <<'EOF'\nprint(1)\nEOF\ncat > b.txt <<'END'\nx\nEND\n```\n"
                    "```bash\ncat > a.py <<'EOF'\nprint(1)\nEOF\nptcluster run a.py\n```\n"
                    "<!-- not-run: on a GPU -->\n```bash\ncat > c.py <<'EOF'\nEOF\n```\n")
    monkeypatch.setattr("tests.support.docblocks.DOCS", tmp_path / "docs")
    found = blocks(page)
    assert [b.writes_files for b in found] == [True, False, False]
