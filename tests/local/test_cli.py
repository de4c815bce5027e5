"""CLI tests through the real entry point (`ptcluster.cli.main`, in process: exit code, stdout,
stderr) and a few runs of the installed `ptcluster` command."""

from __future__ import annotations

import ast
import json
import logging
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ptcluster
from ptcluster.cluster import load_cluster_file, parse_hosts

CLUSTER = "nodes:\n  - {host: n1, slots: 2}\n  - {host: n2, slots: 1, interface: ens4}\n" \
          "interface: eth0\nenv: {NCCL_DEBUG: WARN, ODD: \"it's $HOME\"}\n"


def exported(text: str) -> dict[str, str]:
    """The variables ``env``'s output sets, as bash would read each ``export`` line."""
    out = {}
    for line in text.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            out[key] = shlex.split(value)[0]
    return out


def test_env_prints_exports_per_node(cli, tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(CLUSTER)
    code, out, _ = cli("env", "--cluster", str(f))
    assert code == 0
    blocks = [b for b in out.strip().split("\n\n")]
    assert len(blocks) == 2
    exports = exported(blocks[1])
    assert exports["WORLD_SIZE"] == "3" and exports["NODE_RANK"] == "1"
    assert exports["MASTER_ADDR"] == "n1" and exports["MASTER_PORT"] == "29500"
    assert exports["NCCL_SOCKET_IFNAME"] == "ens4"
    assert exports["ODD"] == "it's $HOME"
    assert "ranks 2..2" in blocks[1]


def test_env_gives_what_is_chosen_at_launch_as_comments_only(cli, tmp_path) -> None:
    """With ``master.port: auto`` and GPUs leased at launch, the port and the GPUs are not known
    yet: the output, sourced by bash, sets neither (a description is no value), and says how
    each is chosen in a comment; the JSON keeps them apart from the values."""
    f = tmp_path / "c.yaml"
    f.write_text("nodes:\n  - {host: n1, slots: 2}\n  - {host: n2, slots: 1, gpus: [3]}\n"
                 "master: {port: auto}\n")
    code, out, _ = cli("env", "--cluster", str(f))
    assert code == 0
    first, second = out.strip().split("\n\n")
    assert "CUDA_VISIBLE_DEVICES" not in "".join(line for line in first.splitlines()
                                                 if not line.startswith("#"))
    assert exported(second)["CUDA_VISIBLE_DEVICES"] == "3"  # indices from the file: a value
    script = f"unset MASTER_PORT CUDA_VISIBLE_DEVICES; {first}\n" \
             'echo "port=${MASTER_PORT-unset} gpus=${CUDA_VISIBLE_DEVICES-unset} ws=$WORLD_SIZE"'
    shown = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "port=unset gpus=unset ws=3"
    code, out, _ = cli("env", "--cluster", str(f), "--node", "n1", "--json")
    data = json.loads(out)
    assert "MASTER_PORT" not in data["env"] and "CUDA_VISIBLE_DEVICES" not in data["env"]
    assert set(data["at_launch"]) == {"MASTER_PORT", "CUDA_VISIBLE_DEVICES", "NCCL_IB_HCA",
                                      "NCCL_IB_GID_INDEX", "NCCL_DEBUG"}
    assert data["at_launch"]["CUDA_VISIBLE_DEVICES"] == \
        "the first 2 free GPUs, leased at launch (on a node that has GPUs)"
    # the text's comments say each one as the JSON does
    assert {f"# {name}: {how}" for name, how in data["at_launch"].items()} <= set(
        first.splitlines())


def test_env_json_and_node_filter(cli, tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(CLUSTER)
    code, out, _ = cli("env", "--cluster", str(f), "--node", "n1", "--json", "--port", "30000")
    assert code == 0
    data = json.loads(out)
    assert data["host"] == "n1" and data["ranks"] == [0, 1]
    assert data["env"]["MASTER_PORT"] == "30000" and data["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
    code, _, err = cli("env", "--cluster", str(f), "--node", "zz")
    assert code == 2 and "n1, n2" in err


def test_bad_cluster_file_exits_2_with_one_line(cli, tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("nodes: [{host: a, slots: 0}]\n")
    code, out, err = cli("env", "--cluster", str(f))
    assert code == 2
    assert "nodes[0].slots" in err and "Fix:" in err and "Traceback" not in err


def test_init_hosts_round_trips(cli, tmp_path) -> None:
    out_file = tmp_path / "cluster.yaml"
    code, out, _ = cli("init", "--hosts", "a:2,b:1,c:1", "-o", str(out_file))
    assert code == 0
    assert f"Next: ptcluster setup --cluster {out_file}, then ptcluster doctor --cluster " \
           f"{out_file}" in out  # setup first: doctor fails on machines setup has not prepared
    spec = load_cluster_file(out_file)
    assert [(n.host, n.slots) for n in spec.nodes] == [("a", 2), ("b", 1), ("c", 1)]
    assert spec.nodes == parse_hosts("a:2,b:1,c:1").nodes and spec.world_size == 4
    assert "port: auto" in out_file.read_text() and spec.master.port is None  # a port per job
    code, _, err = cli("init", "--hosts", "a", "-o", str(out_file))
    assert code == 2 and "--force" in err


def test_init_hostfile(cli, tmp_path) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text("w1 slots=4\nw2 slots=4 # x\n")
    code, out, _ = cli("init", "--hostfile", str(hf), "-o", "-")
    assert code == 0 and "host: \"w1\"" in out and "slots: 4" in out


def test_run_usage_errors(cli, tmp_path, monkeypatch) -> None:
    code, _, err = cli("run")
    assert code == 2 and cli.problem.code == "cli.nothing-to-run", err
    f = tmp_path / "c.yaml"
    f.write_text("nodes: [{host: a}]\n")
    code, _, err = cli("run", "--cluster", str(f), "--nproc", "2", "x.py")
    assert code == 2 and "slots" in err
    assert cli.problem.fields == {"path": str(f), "otherwise": ""}  # given: that file alone
    # found, not given: the way to a run on this machine alone too
    (tmp_path / "cluster.yaml").write_text("nodes: [{host: a}]\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("run", "--nproc", "2", "x.py")
    assert code == 2 and cli.problem.code == "cli.nproc-not-local", err
    assert cli.problem.fields["path"] == "cluster.yaml" and cli.problem.fields["otherwise"]
    code, _, err = cli("run", "--cluster", str(tmp_path / "missing.yaml"), "x.py")
    assert code == 2 and "not found" in err


def test_head_never_imports_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, ptcluster.cli, ptcluster.launch.runner, ptcluster.doctor.diagnose; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_init_without_hosts_and_no_terminal_is_a_usage_error(cli) -> None:
    code, _, err = cli("init", "-o", "-")
    assert code == 2 and "--hosts" in err


# --- every error is one line, through the real entry point -----------------------------------

GOOD = "nodes: [{host: n1, slots: 2}, {host: n2, slots: 1}]\n"


def _files(tmp_path: Path) -> dict[str, str]:
    files = {"good": GOOD, "slots0": "nodes: [{host: a, slots: 0}]\n",
             "yaml": "nodes: [{host: a\n", "empty": ""}
    out = {}
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        out[name] = str(tmp_path / f"{name}.yaml")
    (tmp_path / "adir.yaml").mkdir()
    out["adir"] = str(tmp_path / "adir.yaml")
    out["missing"] = str(tmp_path / "missing.yaml")
    return out


ERRORS = [
    # (id, argv with {name} for a file from _files, exit code, text in the error line)
    ("unknown cluster file", ["env", "--cluster", "{missing}"], 2, "not found"),
    ("bad cluster file", ["env", "--cluster", "{slots0}"], 2, "nodes[0].slots"),
    ("yaml syntax", ["env", "--cluster", "{yaml}"], 2, "YAML"),
    ("empty cluster file", ["doctor", "--cluster", "{empty}"], 2, "empty"),
    ("cluster file is a folder", ["env", "--cluster", "{adir}"], 2, "adir.yaml"),
    ("no such node", ["env", "--cluster", "{good}", "--node", "nosuch"], 2, "'nosuch'"),
    ("--nproc with a cluster file", ["env", "--cluster", "{good}", "--nproc", "2"], 2, "slots"),
    ("init into a missing folder (OSError)", ["init", "--hosts", "a:1", "-o",
                                              "/proc/x/cluster.yaml"], 1, "/proc/x/cluster.yaml"),
    ("init through a file (OSError)", ["init", "--hosts", "a:1", "-o", "/dev/null/x"], 1,
     "Not a directory"),
    ("init into /sys (PermissionError)", ["init", "--hosts", "a:1", "-o", "/sys/cluster.yaml"],
     1, "/sys/cluster.yaml"),
    ("bad --hosts", ["init", "--hosts", "a:x", "-o", "-"], 2, "not an integer"),
    ("missing hostfile", ["init", "--hostfile", "{missing}", "-o", "-"], 2, "not found"),
    ("--hosts and --hostfile", ["init", "--hosts", "a:1", "--hostfile", "{good}"], 2, "one of"),
    ("nothing to run", ["run"], 2, "nothing to run"),
    ("unknown option", ["env", "--bogus"], 2, "--bogus"),
    ("unknown command", ["nosuch"], 2, "nosuch"),
    ("unknown top-level option", ["-x", "env"], 2, "-x"),
    ("bad choice", ["bench", "--op", "nope"], 2, "nope"),
    ("option without its value", ["env", "--cluster"], 2, "--cluster"),
    ("--port out of range", ["env", "--port", "70000"], 2, "70000"),
]


def one_error_line(err: str) -> str:
    """The single `error: ... Fix: ...` line that is the whole of stderr."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Fix: " in lines[0], err
    return lines[0]


@pytest.mark.parametrize("argv,code,text", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_are_one_line_with_a_fix(cli, tmp_path: Path, argv: list[str], code: int,
                                        text: str) -> None:
    files = _files(tmp_path)
    got, out, err = cli(*[a.format(**files) for a in argv])
    assert got == code, err
    assert text in one_error_line(err)
    assert out == ""


@pytest.mark.parametrize("flags", [["-v"], ["-vv"], ["--verbose"], ["-v", "-v"]])
def test_verbose_shows_the_traceback_then_the_line(cli, tmp_path: Path,
                                                   flags: list[str]) -> None:
    missing = str(tmp_path / "missing.yaml")
    code, _, err = cli(*flags, "env", "--cluster", missing)
    assert code == 2
    assert "Traceback" in err and "SpecError" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "not found" in last and "Fix:" in last
    # an OSError too
    code, _, err = cli(*flags, "init", "--hosts", "a:1", "-o", "/proc/x/cluster.yaml")
    assert code == 1 and "Traceback" in err and "FileNotFoundError" in err


def test_a_bug_says_so_and_keeps_its_traceback(cli, tmp_path: Path, monkeypatch) -> None:
    import ptcluster.cli.env_cmd as env_cmd

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(env_cmd, "prepare", broken)
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    code, _, err = cli("env", "--cluster", str(f))
    assert code == 1
    lines = err.splitlines()
    assert lines[0] == "error: ptcluster hit a bug: RuntimeError: boom. Fix: please report it " \
                       "with the traceback below", err
    assert lines[1] == "Traceback (most recent call last):", err
    line = broken.__code__.co_firstlineno + 1  # (where it raised: its last frame, its source)
    assert lines[-3:] == [f'  File "{__file__}", line {line}, in broken',
                          '    raise RuntimeError("boom")', "RuntimeError: boom"], err


def test_bare_command_shows_the_help_not_an_error(cli) -> None:
    code, out, err = cli()
    assert code in (0, 2)  # click < 8.2 exits 0, later versions 2
    assert "error:" not in err
    assert (out + err).strip() == cli("--help")[1].strip()  # the whole help, as --help says it


def test_help_lists_the_commands_grouped_in_the_order_a_user_meets_them(cli) -> None:
    code, out, _ = cli("--help")
    assert code == 0
    sections = [line.strip() for line in out.splitlines() if line.startswith("Commands")]
    assert sections == ["Commands (set up):", "Commands (run):", "Commands (observe):",
                        "Commands (inspect):"]
    listed = [line.split()[0] for line in out.split("Commands (set up):")[1].splitlines()
              if line.startswith("  ")]
    assert listed == ["init", "setup", "doctor", "run", "ps", "kill", "warm", "stacks", "sync",
                      "push", "collect", "submit", "monitor", "bench", "env", "venvs"]


def test_help_and_version_exit_0(cli) -> None:
    code, out, err = cli("--version")
    assert (code, out, err) == (0, f"ptcluster, version {ptcluster.__version__}\n", "")
    code, out, err = cli("env", "-h")
    assert code == 0 and "--node" in out and err == ""


# --- -q and -v reach the commands and the library's logging ----------------------------------

def test_quiet_env_prints_the_exports_alone(cli, tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    code, loud, _ = cli("env", "--cluster", str(f))
    assert code == 0 and any(line.startswith("#") for line in loud.splitlines())
    code, out, err = cli("-q", "env", "--cluster", str(f))
    assert code == 0 and err == ""
    lines = [line for line in out.splitlines() if line]
    assert lines and all(line.startswith("export ") for line in lines)
    assert lines == [line for line in loud.splitlines() if line.startswith("export ")]


def test_quiet_init_writes_silently(cli, tmp_path: Path) -> None:
    f = tmp_path / "cluster.yaml"
    code, out, err = cli("-q", "init", "--hosts", "a:2", "-o", str(f))
    assert code == 0 and out == "" and err == ""
    assert load_cluster_file(f).world_size == 2


QUIET_DOCTOR = """\
ptcluster doctor
┏━━━━━━━━━━┳━━━━━━━━━━━┓
┃ check    ┃ localhost ┃
┡━━━━━━━━━━╇━━━━━━━━━━━┩
│ versions │ ok        │
│ disk     │ FAIL      │
└──────────┴───────────┘
  FAIL disk: localhost: 1 GB free. Fix: free some space
1 check(s) failed (0.0 s)
"""
"""``ptcluster -q doctor`` of a passed versions check and a failed disk, whole (lines compared
without the title's padding)."""


def test_quiet_doctor_keeps_table_failures_and_verdict(cli, monkeypatch) -> None:
    import ptcluster.cli.doctor_cmd as doctor_cmd
    from ptcluster.doctor.checks import FAIL, OK, Finding
    from ptcluster.doctor.diagnose import DoctorReport

    report = DoctorReport(findings=[
        Finding.plain("versions", "localhost", OK, "torch 2.13 everywhere"),
        Finding.plain("disk", "localhost", FAIL, "1 GB free", "free some space")], probes={})
    monkeypatch.setattr(doctor_cmd, "diagnose", lambda *a, **k: report)
    fine, failed = report.findings
    code, loud, _ = cli("doctor", "--nproc", "1")
    assert code == 1 and fine.detail in loud and str(failed.fix) in loud
    code, out, _ = cli("-q", "doctor", "--nproc", "1")
    assert code == 1  # the table, the failures alone with their fixes, the verdict
    assert [line.rstrip() for line in out.splitlines()] == QUIET_DOCTOR.splitlines(), out


@pytest.mark.parametrize("flags,level", [([], logging.WARNING), (["-q"], logging.ERROR),
                                         (["-v"], logging.INFO), (["-vv"], logging.DEBUG),
                                         (["--verbose"], logging.INFO)])
def test_verbosity_sets_the_library_log_level(cli, tmp_path: Path, monkeypatch,
                                              flags: list[str], level: int) -> None:
    import ptcluster.cli.env_cmd as env_cmd

    real = env_cmd.prepare

    def logging_prepare(*args: Any, **kwargs: Any) -> Any:
        lib = logging.getLogger("ptcluster.launch.plan")
        lib.debug("debug-record")
        lib.info("info-record")
        lib.warning("warning-record")
        return real(*args, **kwargs)

    monkeypatch.setattr(env_cmd, "prepare", logging_prepare)
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    code, out, err = cli(*flags, "env", "--cluster", str(f))
    assert code == 0 and "record" not in out
    for name, lvl in (("debug", logging.DEBUG), ("info", logging.INFO),
                      ("warning", logging.WARNING)):
        assert (f"{name}-record" in err) == (lvl >= level), (flags, err)


# --- the installed console script ------------------------------------------------------------

def test_console_script_runs_and_maps_errors(console_script: Path, tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    ok = subprocess.run([str(console_script), "env", "--cluster", str(f)], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and exported(ok.stdout)["WORLD_SIZE"] == "3" and ok.stderr == ""
    for argv, code in ((["init", "--hosts", "a:1", "-o", "/proc/x/cluster.yaml"], 1),
                       (["env", "--cluster", str(tmp_path / "missing.yaml")], 2),
                       (["doctor", "--bogus"], 2)):
        bad = subprocess.run([str(console_script), *argv], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == code, bad.stderr
        one_error_line(bad.stderr)
        assert bad.stdout == ""
    verbose = subprocess.run([str(console_script), "-vv", "env", "--cluster",
                              str(tmp_path / "missing.yaml")], capture_output=True, text=True,
                             timeout=60)
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr


@pytest.mark.parametrize("args", [["env"], ["env", "--json"], ["-q", "env"]])
def test_console_script_reader_gone_ends_quietly(console_script: Path, tmp_path: Path,
                                                 args: list[str]) -> None:
    """`ptcluster env ... | head -1` with the reader gone before we write: no traceback."""
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    proc = subprocess.Popen([str(console_script), *args, "--cluster", str(f)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the only reader: every write of the child now fails with EPIPE
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1
    assert err == "", err


def test_console_script_piped_into_head(console_script: Path, tmp_path: Path) -> None:
    """A real `ptcluster env | head -1` with more output than a pipe holds."""
    f = tmp_path / "big.yaml"
    f.write_text("nodes:\n" + "".join(f"  - {{host: node{i}, slots: 8}}\n" for i in range(400)))
    producer = subprocess.Popen([str(console_script), "env", "--cluster", str(f)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.run(["head", "-1"], stdin=producer.stdout, capture_output=True,
                          timeout=60)
    assert producer.stdout is not None and producer.stderr is not None
    producer.stdout.close()
    err = producer.stderr.read().decode()
    producer.wait(timeout=60)
    assert head.stdout.decode().startswith("# node 0: node0")
    assert "Traceback" not in err and "Error" not in err, err


# --- numeric options: a bad value is a usage error (exit 2, one line), never a run -----------

BAD_NUMBERS = [
    (cmd, opt, value)
    for cmd, opts in {
        "doctor": {"--nproc": ["0", "-1", "x"], "--port": ["0", "65536", "x"],
                   "--timeout": ["-5", "0", "nan", "inf", "x"]},
        "bench": {"--nproc": ["0"], "--port": ["0"], "-b": ["0", "-1", "x"], "-e": ["0"],
                  "-f": ["1", "0", "x"], "-i": ["0", "2Q"], "-n": ["0"], "-w": ["-1"],
                  "-c": ["-1"], "--pair-size": ["0"], "--min-busbw": ["-1", "nan"],
                  "--timeout": ["-5", "0", "inf"]},
        "monitor": {"--interval": ["0", "0.1", "-1", "nan"], "--timeout": ["-5", "0", "nan"]},
        "env": {"--nproc": ["0", "-2"], "--port": ["0", "99999"]},
        "run": {"--nproc": ["0", "-1", "x"], "--port": ["0", "70000", "x"]},
    }.items()
    for opt, values in opts.items() for value in values
]


@pytest.fixture
def nothing_runs(monkeypatch) -> None:
    """A value that gets through would start real work: make that a loud failure instead."""
    import ptcluster.cli.bench_cmd as bench_cmd
    import ptcluster.cli.doctor_cmd as doctor_cmd
    import ptcluster.cli.monitor_cmd as monitor_cmd
    import ptcluster.cli.run_cmd as run_cmd

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bad value got through and the command started")

    monkeypatch.setattr(doctor_cmd, "diagnose", must_not_run)
    monkeypatch.setattr(bench_cmd, "run_bench", must_not_run)
    monkeypatch.setattr(monitor_cmd, "Monitor", must_not_run)
    monkeypatch.setattr(run_cmd, "prepare", must_not_run)


@pytest.mark.parametrize("cmd,opt,value", BAD_NUMBERS,
                         ids=[f"{c} {o} {v}" for c, o, v in BAD_NUMBERS])
def test_bad_numbers_are_usage_errors(cli, nothing_runs: None, cmd: str, opt: str,
                                      value: str) -> None:
    argv = [cmd, opt, value] + (["x.py"] if cmd == "run" else [])
    code, out, err = cli(*argv)
    assert code == 2, err
    line = one_error_line(err)
    assert opt in line or opt.lstrip("-") in line, line
    assert out == ""


def test_good_numbers_still_pass(cli, tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    code, out, _ = cli("env", "--nproc", "1", "--port", "1")
    env = exported(out)
    assert code == 0 and (env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "1")


def test_the_head_raises_its_open_files_limit_to_the_hard_one() -> None:
    """A login's soft limit (1024 on Ubuntu) would cap the nodes a job can have; the CLI raises
    it at start, as servers do (in a child with a low soft limit, so this process is untouched)."""
    import subprocess
    import sys

    code = ("import resource; from ptcluster.cli import raise_open_files_limit as r; "
            "before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]; soft, hard = r(); "
            "print(before, soft, hard, resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run(["bash", "-c", f"ulimit -S -n 256 && {sys.executable} -c '{code}'"],
                         capture_output=True, text=True, check=True).stdout.split()
    before, soft, hard, now = (int(v) for v in out)
    assert before == 256 and now == soft and (soft == hard or hard > 1 << 20)


def test_a_channel_without_descriptors_is_not_a_missing_program() -> None:
    import errno

    from ptcluster.remote.transport import explain_start_failure

    said = explain_start_failure("ssh", OSError(errno.EMFILE, "Too many open files"))
    assert said.code == "node.too-many-open-files" and said.fields["program"] == "'ssh'"
    assert said.fix and said.fields["limit"].endswith(" hard")
    said = explain_start_failure("ssh", FileNotFoundError(errno.ENOENT, "No such file"))
    assert (said.code, said.fields["error"]) == ("node.no-ssh-client", "No such file")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the script "
                    "runs every path for real there (scripts/gpu_check.sh)")
def test_gpu_check_skips_every_path_with_the_reason_without_a_gpu() -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    said = [(line.split()[0], line.split()[1]) for line in p.stdout.splitlines()]
    assert said == [(path, "skip:") for path in (  # (path, ok: | FAIL: | skip: why)
        "gpu-driver-health", "local-nproc", "doctor+nvml", "bench-nccl", "bench-predict",
        "monitor", "metrics-dcgm", "trainer-cuda-bf16", "nccl-transport", "gpus-auto-busy",
        "slurm-gres", "checkpoint-cuda")], p.stdout
    assert len({line.split(None, 2)[2] for line in p.stdout.splitlines()}) == 1  # one reason


def test_the_testbed_scripts_help_says_whole_sentences() -> None:
    """``scripts/testbed.py --help`` shows its docstring whole (its first line alone stopped
    mid-sentence), with a run command that reads the testbed's cluster file."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "scripts" / "testbed.py"), "--help"],
                          capture_output=True, text=True, timeout=60, check=True)
    usage, _, rest = proc.stdout.partition("\n\n")
    description = rest.split("\npositional arguments:\n")[0]
    doc = ast.get_docstring(ast.parse((root / "scripts" / "testbed.py").read_text()))
    assert usage.startswith("usage: testbed.py ") and description.strip() == doc, proc.stdout
    assert description.split("\n\n")[0] == "Bring up the multi-host testbed by hand (root)."
    lines = description.splitlines()  # (the run command: a line and its continuation)
    at = next(i for i, line in enumerate(lines) if "ptcluster run" in line)
    argv = shlex.split(lines[at].removesuffix("\\") + lines[at + 1])
    assert argv[:3] == [".venv/bin/ptcluster", "run", "--trust-cluster-file"], argv
    assert argv[argv.index("--cluster") + 1] == "testbed-cluster.yaml", argv


def test_doctor_json_gives_each_problem_its_code_and_fields(cli, tmp_path) -> None:
    """A node whose sshd does not listen: doctor --json names the channel's diagnosis by its
    code (the finding's and the node's), with the last line ssh printed as its field."""
    import json

    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n  - {host: 127.0.0.1, ssh: {port: 1}}\n")
    code, out, err = cli("doctor", "--cluster", str(path), "--skip-allreduce", "--json",
                         "--timeout", "20")
    assert code == 1, err
    report = json.loads(out)
    (ssh,) = [f for f in report["findings"] if f["check"] == "ssh"]
    assert (ssh["status"], ssh["code"]) == ("fail", "node.ssh-unreachable"), ssh
    assert "port 1" in ssh["fields"]["detail"] and ssh["fix"], ssh
    assert report["nodes"]["127.0.0.1"]["code"] == "node.ssh-unreachable"
    assert {f["code"] for f in report["findings"] if f["status"] == "skip"} == {None}
