"""The docs' reference pages, generated from the code so they cannot drift.

Each page is rendered from the table the program itself uses: the commands and options from the
click app (what ``--help`` prints), the cluster-file keys from ``cluster.keys`` (what the loader
accepts), the exit codes from ``cli.exits``, ``summary.json``'s fields from a real
``RunResult.to_json`` (a field without a description below fails the docs test), the known
failures from ``launch.supervise.known``, and what doctor, the health gate, the guard and the
node channel report from their tables of declared problems (``node.problems``). Objects are
read, never a function's body. ``scripts/docs_hooks.py`` adds them to the site at every
``mkdocs build`` (pyinfra generates its operations reference the same way, from
``scripts/generate_*.py``). It lives with the docs build: it is not a command.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click

from ptcluster.cli.exits import EXIT_CODES
from ptcluster.node.problems import Declared

_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _cell(text: str) -> str:
    """Text for one markdown table cell: a ``|`` escaped outside code spans. Inside one it
    stays as it is: Python-Markdown's tables never split a row at a pipe within backticks, and
    show a backslash written there (``ps aux \\| head`` on the site)."""
    text = " ".join(text.split())
    out, at = [], 0
    for m in _CODE_SPAN.finditer(text):
        out += [text[at:m.start()].replace("|", "\\|"), m.group(0)]
        at = m.end()
    return "".join(out) + text[at:].replace("|", "\\|")


def _root() -> click.Group:
    from ptcluster.cli import all_commands, cli  # (here: cli/__init__ is the app's module)

    all_commands()  # (each command's module is imported when first asked for)
    return cli


def option_rows(cmd: click.Command, ctx: click.Context) -> list[tuple[str, str]]:
    """(the option as ``--help`` shows it, its help with the default) for every parameter."""
    rows = []
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if isinstance(param, click.Argument):
            rows.append((param.make_metavar(ctx), "argument"))
        elif record is not None:
            rows.append(record)
    return rows


def commands_page() -> str:
    from ptcluster.cli import SECTIONS

    root = _root()
    lines = ["# Commands", "",
             "Every command and option, generated from the command-line app itself (what "
             "`ptcluster COMMAND --help` prints). The commands in the order you meet them.", ""]
    # the app's own context settings (``-h``): click caches each command's help option from the
    # first context that asks for it, so a bare Context would leave ``-h`` out of --help too
    with click.Context(root, info_name="ptcluster", **root.context_settings) as top:
        lines += ["## ptcluster", "", "```text", root.get_usage(top), "```", "",
                  _cell(root.help or ""), "", "| option | what it does |", "| --- | --- |"]
        lines += [f"| `{o}` | {_cell(h)} |" for o, h in option_rows(root, top)]
        lines.append("")
        for title, names in SECTIONS:
            lines += [f"## {title}", ""]
            for name in names:
                cmd = root.commands[name]
                with click.Context(cmd, info_name=name, parent=top) as ctx:
                    lines += [f"### ptcluster {name}", "", "```text", cmd.get_usage(ctx), "```",
                              "", (cmd.help or "").strip(), "",
                              "| option | what it does |", "| --- | --- |"]
                    lines += [f"| `{o}` | {_cell(h)} |" for o, h in option_rows(cmd, ctx)]
                    lines.append("")
    return "\n".join(lines)


def cluster_file_page() -> str:
    from ptcluster.cluster.keys import KEYS

    lines = ["# The cluster file", "",
             "Every key a cluster file (`cluster.yaml`) may hold, generated from the table the "
             "loader takes its keys from (`ptcluster/cluster/keys.py`). Any other key is refused "
             "with exit 2 and a line that names the file, the key and the fix.", "",
             "| key | type | default | example | what it does |",
             "| --- | --- | --- | --- | --- |"]
    for k in KEYS:
        lines.append(f"| `{k.path}` | {_cell(k.type)} | {_cell(k.default)} | "
                     f"{_cell(f'`{k.example}`')} | {_cell(k.doc)} |")
    lines.append("")
    return "\n".join(lines)


def _problems_section(title: str, intro: str, entries: Iterable[Declared]) -> list[str]:
    """A section of a page: its title, a sentence before the table (none: ""), the table."""
    return ["", f"## {title}", "", *([intro, ""] if intro else []),
            "| code | problem | what | fix |", "| --- | --- | --- | --- |", *problem_rows(entries)]


def exit_codes_page() -> str:
    from ptcluster.checkpoint.collect import TABLE as CHECKPOINT
    from ptcluster.cli.problems import TABLE as CLI
    from ptcluster.control.kill import TABLE as KILL
    from ptcluster.control.protocol import TABLE as CONTROL
    from ptcluster.node.blobs import TABLE as FILE
    from ptcluster.node.data_agent import TABLE as NODE_PUSH
    from ptcluster.node.kill import TABLE as NODE_KILL
    from ptcluster.push.scan import TABLE as PUSH
    from ptcluster.remote.slurm import TABLE as SLURM
    from ptcluster.setup.problems import STEP_REASONS, STOPS
    from ptcluster.submit.sbatch import TABLE as SUBMIT

    lines = ["# Exit codes", "", "What every `ptcluster` command exits with "
             "(`ptcluster/cli/exits.py`).", "", "| code | meaning |", "| --- | --- |"]
    lines += [f"| {code} | {_cell(meaning)} |" for code, meaning in EXIT_CODES]
    lines += _problems_section("What the command line refuses (exit 2)", "", CLI)
    lines += _problems_section(
        "What submit, a run inside a Slurm allocation and push refuse (exit 2)", "",
        SUBMIT + SLURM + PUSH)
    lines += _problems_section(
        "What a node fails a push for (exit 1)",
        "`push` and `run --data` name the node (and the file); `file.*` is also why a node "
        "could not build the project's environment (a wheel that did not arrive):",
        NODE_PUSH + FILE)
    lines += _problems_section("What collect refuses (exit 1)", "", CHECKPOINT)
    lines += _problems_section(
        "Why kill did not end a job on a node (exit 1)",
        "`kill` through the nodes' guards names each node where the job's guard was not "
        "signalled, and why:", NODE_KILL + KILL)
    lines += _problems_section(
        "Why a running job's head could not be asked (exit 1)",
        "`stacks` and `kill` ask a job's head on its control socket (`kill` then goes through "
        "the nodes' guards instead):", CONTROL)
    lines += ["", "## Why setup changes a step, or cannot (exit 1 until every node converged)",
              "", "Each step of `ptcluster setup`'s plan that is not ok says why, with its code "
              "(`setup --json`: the step's `code` and `fields`); the fix says what apply does "
              "(change) or who can do it (blocked):", "",
              "| status | code | problem | what | fix |", "| --- | --- | --- | --- | --- |"]
    lines += problem_rows(STEP_REASONS, "status")
    lines += _problems_section(
        "Why setup stops on a node (exit 1)",
        "The node's `problem` in `setup --json`, with its `code` and `fields`; the other nodes "
        "go on:", STOPS)
    lines.append("")
    return "\n".join(lines)


SUMMARY_FIELDS: dict[str, str] = {
    "job_id": "The job's id (also in the run directory's name, `ps` and `kill`).",
    "ok": "True when every rank of the last attempt exited 0.",
    "outcome": "How the run ended, one word the exit code follows from: `succeeded`, `failed`, "
               "`hung`, `no progress`, `interrupted` or `ended outside` (Slurm ended it).",
    "signal": "The signal to the head that stopped the job (`SIGINT`, `SIGTERM`), else null.",
    "interrupted": "The job was stopped (Ctrl-C, SIGTERM, `ptcluster kill`, Slurm).",
    "gave_up": "Why no further attempt was made after a failed one (`--max-restarts`).",
    "gave_up_code": "`gave_up`'s code (`run.no-restarts-left`, `run.too-few-nodes`, "
                    "`run.no-progress`; null for none, or a stop).",
    "gave_up_fields": "The values `gave_up`'s text was filled with (`used`, `most`; `left`, "
                      "`dropped`, `min_nodes`; `attempt`, `since`).",
    "no_progress": "The restarts gave up: an attempt saved no newer checkpoint (exit 3).",
    "ended_by": "Who ended the job from outside (Slurm's scancel, time limit, preemption; "
                "`ptcluster kill`).",
    "attempts": "Every attempt in order: hosts, world size, master port, cause, step resumed "
                "from, newest checkpoint, downtime, nodes dropped and why, the spare that "
                "takes each one's place (`replaced`: node to spare), the nodes lost earlier that "
                "answered again and were taken back into the next attempt (`readmitted`); how "
                "each ended (`end`, in `outcome`'s words: `planned restart` for one stopped by "
                "`run --readmit` at `planned_step`, the checkpoint every rank saved); per node, "
                "whether its ranks were forked from a warm pool (`warm`: `run --warm`, or the "
                "job's own pool on a restart) or started cold by torchrun.",
    "went_cold": "Failures after which the same attempt was launched again with every "
                 "node's ranks cold, not counted as a restart: `guard.pool-lost`, a node's warm "
                 "pool that failed at its fork after the other nodes' had forked theirs "
                 "(pooled and cold ranks never meet). Empty when none.",
    "waited": "`run --wait`: the refusals it waited out, others holding what it asks for "
              "(`guard.gpus-busy`, `guard.port-leased`, each node's in the root cause's "
              "shape), one list each time the waiting note said them. Not failures of the "
              "job. Empty without a wait.",
    "spares": "Each spare that took a node's place (`spares:` of the cluster file): after "
              "which attempt, the node, the spare, and why the node was left out.",
    "duration_s": "Seconds from start to the end of the teardown.",
    "console_dropped": "Lines the console skipped because it could not keep up (all are in the "
                       "logs).",
    "log_errors": "Logs that could not be written, with the first error and the lines they "
                  "miss.",
    "root_cause": "The failure that happened first (on corrected clocks): host, rank, kind "
                  "(`rank`, `lost`, `hang`, `oom`, `gpu`, `disk`, `unhealthy`, …), message, "
                  "fix, the known failure it is, exit code, last lines, what the node saw "
                  "(`facts`; `hung_after`: what a rank raised before it hung until the "
                  "teardown ended it); "
                  "for a declared problem (a guard's refusal, the health gate's, a node that "
                  "could not be reached) its `code` (`guard.port-in-use`, `health.memory-low`, "
                  "`node.ssh-key-refused`: [doctor's checks](../troubleshooting/doctor-checks.md) "
                  "lists them) and the values its message was filled with (`fields`).",
    "failures": "Every failure in the order it happened, in the root cause's shape.",
    "hang_report": "Every rank's stacks when `--hang-timeout` found a hang, the straggler "
                   "first.",
    "straggler": "The straggler report of the last attempt: every rank's wait share, the "
                 "history, the peak ratio and every evaluation's ratios; a verdict's `why` "
                 "and, as figures, `seen` (`cpu_starved`, `cpu_throttled`, `mem_available`, "
                 "`gpu_util`: what the node saw past its limit).",
    "nccl": "What NCCL chose on each GPU node, read from its own log (`NCCL_DEBUG_FILE`): "
            "`{node: {transport, hca, gid_index, ...}}`; `transport` is `IB` (InfiniBand or "
            "RoCE: `link` says which) or `Socket`, and `cause` says why a node with HCAs used "
            "sockets.",
    "ranks": "Every rank: host, local rank, exit code, status, duration, start and end.",
    "nodes": "Every node: node rank, ready, the interface it chose and why, GPUs, hostname, "
             "clock offset, address, torch and NCCL versions, the `NCCL_IB_HCA` / "
             "`NCCL_IB_GID_INDEX` its RDMA devices call for (`rdma`), how its guard and "
             "transport ended, GPU errors the driver reported.",
}


def sample_summary() -> dict[str, Any]:
    """A real ``summary.json`` body (an empty, successful job): its keys are the fields."""
    from ptcluster.launch.result import RunResult

    return RunResult(job_id="x", run_dir=Path("."), ranks=[], nodes=[], failures=[],
                     interrupted=False, duration=0.0).to_json()


def summary_page() -> str:
    lines = ["# summary.json", "",
             "Every run directory (`./ptcluster-runs/<time>-<id>/`) holds `summary.json`, "
             "written as the job ends. Its top-level fields:", "",
             "| field | what it holds |", "| --- | --- |"]
    lines += [f"| `{key}` | {_cell(SUMMARY_FIELDS.get(key, ''))} |" for key in sample_summary()]
    lines.append("")
    return "\n".join(lines)


def known_failures_page() -> str:
    from ptcluster.launch.problems import TABLE as RUN
    from ptcluster.launch.supervise.known import as_markdown
    from ptcluster.launch.supervise.machine_view import TABLE as MACHINE
    from ptcluster.launch.supervise.restart import GAVE_UP

    head = ["| code | problem | what | fix |", "| --- | --- | --- | --- |"]
    lines = ["", "## What the machine saw of a rank's death (run)", "",
             "What `run` says of a rank the kernel's out-of-memory killer or systemd-oomd "
             "ended, that failed after the GPU driver reported an Xid, or whose filesystem was "
             "full (`summary.json`: the failure's `kind` `oom`, `gpu` or `disk`, its `code`, "
             "`fields` and `facts`):", "", *head, *problem_rows(MACHINE),
             "", "## A node or the job failed (run)", "",
             "What `run` says when a node, not a rank, failed or the job as a whole did "
             "(`summary.json`: the failure's `code` and `fields`), or when the head cannot "
             "start the job at all (its one error line):", "", *head,
             *problem_rows(e for e in RUN if e not in MACHINE and e not in GAVE_UP),
             "", "## Why a failed job was not restarted (run --max-restarts)", "",
             "The job ends with its root cause, and `summary.json`'s `gave_up` says why no "
             "further attempt was made (`gave_up_code`, `gave_up_fields`):", "", *head,
             *problem_rows(GAVE_UP)]
    return as_markdown().rstrip("\n") + "\n" + "\n".join(lines) + "\n"


def render(path: str) -> str:
    """The generated page at ``path`` (a key of :data:`PAGES`)."""
    return PAGES[path]()


def rank_env_page() -> str:
    """The variables ptcluster gives each node's ranks on a 2+1+1 cluster: ``rank_env``, what
    ``ptcluster env`` prints and what the node's torchrun is started with."""
    from ptcluster.cluster.load import parse_hosts
    from ptcluster.launch.api import prepare
    from ptcluster.launch.plan import JOB_VAR, Target, rank_env, rank_env_at_launch

    plan = prepare(parse_hosts("head:2,node1:1,node2:1"), Target(code=""), port=None)
    per_node = [{**dict(rank_env(plan, node)),
                 **{k: f"*{how}*" for k, how in rank_env_at_launch(plan, node)}}
                for node in plan.nodes]
    names = list(dict.fromkeys(k for env in per_node for k in env))
    lines = ["# The environment a rank gets", "",
             "What every rank of a job gets from ptcluster, here for the cluster "
             "`head:2,node1:1,node2:1` (generated from the launch plan, as "
             "`ptcluster env` prints it for your own cluster). On each node torchrun then "
             "adds, per process, `RANK`, `LOCAL_RANK` and its other variables, as it always "
             "does. `NCCL_SOCKET_IFNAME` and `GLOO_SOCKET_IFNAME` are the cluster file's "
             "`interface:`, or (as here, where none is set) the interface each node detects "
             "at launch on its route to the master. A value in italics is chosen only when the "
             "job starts; `ptcluster env` prints it as a comment, never as an export. On a "
             "node without a GPU, in a job that runs gloo, the ranks also get "
             "`ACCELERATE_USE_CPU=true` (Accelerate otherwise counts one process), unless "
             "their environment sets it. "
             "Nothing else of the head's environment is shipped; your cluster file's `env:` "
             "is added to this.", "",
             "| variable | " + " | ".join(f"node {n.node_rank}: `{n.host}`"
                                         for n in plan.nodes) + " |",
             "| --- |" + " --- |" * len(plan.nodes)]
    for name in names:
        values = ["(a new id per job)" if name == JOB_VAR else env.get(name, "—")
                  for env in per_node]
        lines.append(f"| `{name}` | " + " | ".join(_cell(v) for v in values) + " |")
    lines.append("")
    return "\n".join(lines)


def template(text: str) -> str:
    """A declared text as the page shows it: each ``{field}`` as ‹field› (a value filled in when
    the problem is found)."""
    return "".join(lit + (f"‹{name}›" if name else "")
                   for lit, name, _, _ in string.Formatter().parse(text))


def problem_rows(entries: Iterable[Declared], *first: str) -> list[str]:
    """One table row per declared problem: ``first`` cells (each entry's, by attribute), its
    code, its title, what it says and the fix."""
    return [f"| {' | '.join(str(getattr(e, a)) for a in first)}"
            f"{' | ' if first else ''}`{e.code}` | {_cell(e.title)} | "
            f"{_cell(template(e.what))} | {_cell(template(e.fix))} |" for e in entries]


def doctor_checks_page() -> str:
    from ptcluster.doctor.checks import FAST_CHECKS
    from ptcluster.doctor.findings import TABLE
    from ptcluster.node.facts.gpu_errors import XID_ACTIONS
    from ptcluster.node.facts.health import REFUSALS, WARNINGS
    from ptcluster.node.guard.refusal import TABLE as GUARD
    from ptcluster.node.venv_problems import DIFFERENCES, NOT_BUILT
    from ptcluster.remote.diagnoses import TABLE as NODE
    from ptcluster.venvs.problems import TABLE as VENVS

    lines = ["# doctor's checks and their fixes", "",
             "Every check `ptcluster doctor` (and `run --preflight`) makes, and every warning "
             "or failure it reports with its fix, generated from the tables they are declared "
             "in (`ptcluster/doctor/findings.py`, `remote/diagnoses.py`, `node/facts/health.py`, "
             "`node/guard/refusal.py`). Each has a code, which `doctor --json` and "
             "`summary.json` give (`code`, and the values its text was filled with: "
             "`fields`); ‹name› is such a value. After the checks doctor runs the compute "
             "probe and a real all-reduce over every rank.", "",
             "| check | what it verifies |", "| --- | --- |"]
    for check in FAST_CHECKS:
        name = check.__name__.removeprefix("check_").replace("_", " ")
        what = (check.__doc__ or "").split("\n\n")[0] or "see the fixes below"
        lines.append(f"| {name} | {_cell(what)} |")
    lines += ["", "## What it reports, and the fix", "",
              "| check | status | code | problem | what | fix |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += problem_rows(TABLE, "check", "status")
    lines += ["", "## A node it cannot reach, or whose Python does not start (ssh, python)", "",
              "doctor's `ssh` or `python` row fails with one of these (so does any command "
              "whose node program dies before it says anything: the last line ssh, Slurm or "
              "the shell printed decides which, and is ‹detail›):", "",
              "| code | problem | what | fix |", "| --- | --- | --- | --- |"]
    lines += problem_rows(NODE)
    lines += ["", "## What the health gate refuses a node for (health)", "",
              "The same checks `run` makes on every node before any rank starts (a restart "
              "leaves such a node out; `summary.json`'s failure has the first one's code); "
              "doctor's `health` row fails with each:", "",
              "| code | problem | what | fix |", "| --- | --- | --- | --- |"]
    lines += problem_rows(REFUSALS)
    lines += ["", "What doctor warns of on GPUs that work (`gpu-health`), never refused:", "",
              "| code | problem | what | fix |", "| --- | --- | --- | --- |"]
    lines += problem_rows(WARNINGS)
    lines += ["", "A GPU's Xid is refused or answered by the action NVIDIA's catalog gives it "
              "([why a job died](../guides/why-a-job-died.md)):", "", "| action | fix |",
              "| --- | --- |"]
    lines += [f"| {action} | {_cell(text.format(gpu='N'))} |"
              for action, text in XID_ACTIONS.items()]
    lines += ["", "## What a node's guard refuses a job for (run)", "",
              "Before any rank starts, each node's guard checks what the job needs there; a "
              "refusal ends the attempt with the node named (`summary.json`: its failure's "
              "`code`, kind `guard`, `busy` where another job holds what it asks for):", "",
              "| code | problem | what | fix |", "| --- | --- | --- | --- |"]
    lines += problem_rows(GUARD)
    lines += ["", "## What the project's environment is refused for (venvs)", "",
              "`run`, `venvs` and doctor's `environment` row refuse a requirements file, or a "
              "node, with one of these:", "",
              "| code | problem | what | fix |", "| --- | --- | --- | --- |"]
    lines += problem_rows(VENVS)
    lines += ["", "How a node's environment differs from its build (doctor's `environment` row "
              "fails with each difference, file by file; `run` rebuilds such an environment):",
              "", "| code | problem | what | fix |", "| --- | --- | --- | --- |"]
    lines += problem_rows(DIFFERENCES)
    lines += ["", "Why a node could not build the environment (`run` names the node and fails "
              "before any rank starts):", "", "| code | problem | what | fix |",
              "| --- | --- | --- | --- |"]
    lines += problem_rows(NOT_BUILT)
    lines.append("")
    return "\n".join(lines)


PAGES: dict[str, Callable[[], str]] = {
    "reference/commands.md": commands_page,
    "reference/cluster-file.md": cluster_file_page,
    "reference/exit-codes.md": exit_codes_page,
    "reference/summary-json.md": summary_page,
    "reference/rank-environment.md": rank_env_page,
    "troubleshooting/known-failures.md": known_failures_page,
    "troubleshooting/doctor-checks.md": doctor_checks_page,
}
"""Generated page (path under docs/) -> the function that renders it."""
