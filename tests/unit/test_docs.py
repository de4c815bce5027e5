"""The docs cannot drift: every command option and cluster-file key is documented, the generated
reference renders, and every shell block of the pages a user follows either runs
(tests/local/test_docs_site.py runs them, and builds the site) or says why it cannot."""

from __future__ import annotations

import re

import click
import pytest
import yaml

from ptcluster.cli import SECTIONS, all_commands, cli
from ptcluster.cli import reference as ref
from ptcluster.cli.exits import EXIT_CODES
from ptcluster.cluster.keys import KEYS, keys_at
from ptcluster.cluster.load import spec_from_data
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
    assert "| `-h, --help` |" in page
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
        "summary.json has fields without a description in cli/reference.py (or the reverse): "
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


def test_every_doctor_check_is_documented_with_its_fixes() -> None:
    from ptcluster.doctor.checks import FAST_CHECKS

    page = ref.doctor_checks_page()
    for check in FAST_CHECKS:  # every check is on the page, described where it says what it does
        assert f"| {check.__name__.removeprefix('check_').replace('_', ' ')} |" in page
    findings = ref.doctor_findings()
    checks_with_fixes = {name for name, *_ in findings}
    assert {"workdir", "interface", "hostname", "master port", "clock"} <= checks_with_fixes
    assert all(f"| {ref._cell(fix)} |" in page for *_, fix in findings)
    assert "set master.port: auto (every job takes a free port)" in page
    # fixes the code sets through a name, a helper or a table are there too
    for fix in ("free disk space in workdir for checkpoints and logs",  # status, fix = WARN, …
                "install your key on the node: ssh-copy-id, or `ptcluster setup`",  # ssh's words
                "give the node fewer slots",  # the health gate's memory refusal
                "uncorrectable ECC error(s) since the driver loaded",  # gathered, then joined
                "raise the open-files limit"):
        assert fix in page, fix


def test_no_doctor_finding_with_a_fix_is_left_off_its_page() -> None:
    """Every warning or failure a doctor function reports with a fix has a row: a fix the page
    cannot read (computed in a new way) fails here, not silently."""
    import ast
    import inspect
    import textwrap

    rows = {}
    for name, *_ in ref.doctor_findings():
        rows[name] = rows.get(name, 0) + 1
    for func in ref.doctor_functions():
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        wanted: dict[str, int] = {}
        for call in ref._calls(tree, "Finding"):
            status = getattr(call.args[2], "id", "") if len(call.args) > 2 else ""
            fix = ref._arg(call, 4, "fix")
            name = ref._literal(call.args[0]) if call.args else None
            if status in ("WARN", "FAIL") and name and fix is not None and not (
                    isinstance(fix, ast.Constant) and fix.value is None):
                wanted[name] = wanted.get(name, 0) + 1
        for name, n in wanted.items():
            if name in ("ssh", "python"):  # their fixes: the node-problems table
                assert ref.node_problems()
            elif name == "health":  # the health gate's table
                assert len(ref.health_refusals()) >= 5
            else:
                assert rows.get(name, 0) >= n, f"{func.__name__}: {name}'s fixes not all read"


def test_a_table_cell_escapes_pipes_outside_code_spans_only() -> None:
    """A pipe splits a row unless escaped, but inside backticks Python-Markdown keeps it (and
    would show the backslash): ``ps aux --sort=-rss | head`` read ``ps aux … \\| head``."""
    assert ref._cell("see `ps aux | head` | or `a|b`") == "see `ps aux | head` \\| or `a|b`"
    assert ref._cell("``ended by `k` | x`` |  y") == "``ended by `k` | x`` \\| y"
    assert ref._cell("a | b\n c") == "a \\| b c"


def test_the_known_failures_page_is_the_table() -> None:
    from ptcluster.launch.supervise.known import TABLE

    page = ref.render("troubleshooting/known-failures.md")
    assert all(f"(`{k.name}`)" in page for k in TABLE)


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
    assert ".venv/bin/mkdocs serve" in readme and "bash scripts/test.sh" in readme


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
