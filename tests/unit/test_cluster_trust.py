"""A cluster file is configuration, not code (SECURITY-REVIEW findings 11, 14, 17): the ssh
settings that run a program on the head or change which host keys ssh trusts are refused
unless the file is trusted; hosts carry no shell metacharacters, not even in an IPv6 scope id;
a key of any shape is a spec error, never a traceback."""

from __future__ import annotations

import os

import pytest

from ptcluster.cluster import parse_cluster_text
from ptcluster.cluster.validate import is_host
from ptcluster.errors import SpecError
from ptcluster.remote.transport import ssh_argv

NEEDS_TRUST = [
    # runs a program on the head
    ("ProxyCommand", "sh -c 'touch /tmp/owned'"),
    ("LocalCommand", "touch /tmp/owned"),
    ("PermitLocalCommand", "yes"),
    ("KnownHostsCommand", "/bin/echo"),
    ("RemoteCommand", "id"),
    ("PKCS11Provider", "/tmp/evil.so"),
    ("SecurityKeyProvider", "/tmp/evil.so"),
    ("XAuthLocation", "/tmp/evil"),
    # switches host-key checking off, or picks the keys it trusts
    ("StrictHostKeyChecking", "no"),
    ("StrictHostKeyChecking", "off"),
    ("StrictHostKeyChecking", False),
    ("StrictHostKeyChecking", "accept-new"),  # (whatever answers first is believed: L7)
    ("UserKnownHostsFile", "/dev/null"),
    ("GlobalKnownHostsFile", "./known_hosts"),
    ("NoHostAuthenticationForLocalhost", "yes"),
    ("HostKeyAlias", "trusted-host"),
    # hands the node what is yours, or a door to this machine
    ("ForwardAgent", "yes"),
    ("ForwardX11", "yes"),
    ("RemoteForward", "2222 localhost:22"),
    ("SendEnv", "AWS_*"),
    ("ControlPath", "/tmp/theirs.sock"),
    ("IdentityAgent", "/tmp/theirs.sock"),
    # not known to be harmless: refused until someone says it is
    ("SomeFutureOption", "x"),
]


@pytest.mark.parametrize("name,value", NEEDS_TRUST, ids=[f"{n}={v}" for n, v in NEEDS_TRUST])
@pytest.mark.parametrize("where", ["top", "node"])
def test_ssh_options_that_are_code_need_trust(name: str, value: object, where: str) -> None:
    options = {name: value}
    text = (f"nodes: [{{host: a}}]\nssh: {{options: {options!r}}}\n" if where == "top" else
            f"nodes: [{{host: a, ssh: {{options: {options!r}}}}}]\n")
    with pytest.raises(SpecError) as info:
        parse_cluster_text(text, "cluster.yaml")
    message = str(info.value)
    assert f"ssh.options.{name}" in message and "--trust-cluster-file" in message, message
    assert "~/.ssh/config" in message and "\n" not in message, message
    spec = parse_cluster_text(text, "cluster.yaml", trusted=True)  # the user's own file
    assert spec.nodes[0].ssh.options[0][0] == name


SAFE = [
    ("ServerAliveInterval", 5), ("ConnectTimeout", 7), ("BatchMode", "yes"),
    ("StrictHostKeyChecking", "yes"),
    ("StrictHostKeyChecking", True), ("ProxyJump", "bastion"),
    ("ProxyJump", "me@bastion.example:2222,other"), ("ProxyJump", "ssh://me@[fe80::1%eth0]:22"),
    ("IdentitiesOnly", "yes"), ("IdentityFile", "~/.ssh/id_lab"), ("Compression", "yes"),
    ("User", "ubuntu"), ("Hostname", "10.0.0.3"), ("Port", 2222),
]


@pytest.mark.parametrize("name,value", SAFE, ids=[f"{n}={v}" for n, v in SAFE])
def test_ssh_options_that_only_tune_the_connection_are_fine(name: str, value: object) -> None:
    spec = parse_cluster_text(f"nodes: [{{host: a}}]\nssh: {{options: {{{name}: {value!r}}}}}\n",
                              "cluster.yaml")
    assert spec.nodes[0].ssh.options[0][0] == name


@pytest.mark.parametrize("value", ["-oProxyCommand=x", "a;b", "me@$(id)", "a b", "host:x"])
def test_a_proxy_jump_is_hosts_only(value: str) -> None:
    with pytest.raises(SpecError, match="ssh.options.ProxyJump"):
        parse_cluster_text(f"nodes: [{{host: a}}]\nssh: {{options: {{ProxyJump: {value!r}}}}}\n",
                           "cluster.yaml")


def test_an_ssh_config_file_outside_your_ssh_directory_needs_trust(tmp_path) -> None:
    """``-F`` replaces ~/.ssh/config with a file ptcluster cannot check (ProxyCommand, Match
    exec, Include): one in ~/.ssh is yours; one anywhere else (a cloned repo's) needs trust."""
    text = "nodes: [{host: a}]\nssh: {config_file: %s}\n"
    for path in ("./ssh_config", str(tmp_path / "cfg"), "~/../tmp/cfg"):
        with pytest.raises(SpecError, match="ssh.config_file.*--trust-cluster-file"):
            parse_cluster_text(text % path, "cluster.yaml")
        assert parse_cluster_text(text % path, "cluster.yaml", trusted=True)
    for path in ("~/.ssh/config", "~/.ssh/lab.conf", os.path.expanduser("~/.ssh/config"),
                 "none"):
        assert parse_cluster_text(text % path, "cluster.yaml").nodes[0].ssh.config_file == path


def test_ssh_gets_the_config_file_at_its_real_path() -> None:
    """ssh does not expand ``~`` in ``-F`` (it would read ./~/.ssh/config, a file a cloned
    repository can ship): the head expands it."""
    spec = parse_cluster_text("nodes: [{host: a}]\nssh: {config_file: ~/.ssh/config}\n", "c")
    argv = ssh_argv("a", spec.nodes[0].ssh)
    assert argv[argv.index("-F") + 1] == os.path.expanduser("~/.ssh/config")


@pytest.mark.parametrize("host", [
    "fe80::1%eth0", "fe80::1%enp3s0f0.100", "fe80::1%br-lan_1", "fe80::1%3", "10.0.0.1",
    "::1", "node-1.example",
])
def test_hosts(host: str) -> None:
    assert is_host(host)


@pytest.mark.parametrize("host", [
    "fe80::1%$(touch x)", "fe80::1%a;b", "fe80::1%`id`", "fe80::1%a\nb", "fe80::1%a b",
    "fe80::1%", "fe80::1%a'b", "fe80::1%a|b", "fe80::1%a&b", "fe80::1%a>b", "fe80::1%-x",
])
def test_a_scope_id_is_an_interface_name_not_a_command(host: str) -> None:
    assert not is_host(host)
    with pytest.raises(SpecError, match="not a valid hostname"):
        parse_cluster_text(f"nodes: [{{host: {host!r}}}]\n", "c.yaml")


@pytest.mark.parametrize("text", [
    "? [a, b]\n: 1\nnodes: [{host: a}]\n",
    "? {a: 1}\n: 1\nnodes: [{host: a}]\n",
    "nodes: [{host: a, ? [x]: 1}]\n",
    "nodes: [{host: a}]\nssh: {options: {? [x]: 1}}\n",
    "nodes: [{host: a}]\nenv: {? {a: b}: 1}\n",
])
def test_a_key_that_is_a_list_or_mapping_is_a_spec_error(text: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_cluster_text(text, "c.yaml")
    assert "c.yaml" in str(info.value) and "key" in str(info.value), str(info.value)


SHAPES = [[1], {"a": 1}, [[1]], {"a": [1]}, None, 1.5, True, "x"]
PATHS = [("backend",), ("interface",), ("python",), ("workdir",), ("env",), ("env", "A"),
         ("gpus",), ("master",), ("master", "addr"), ("master", "port"), ("ssh",),
         ("ssh", "user"), ("ssh", "port"), ("ssh", "identity_file"), ("ssh", "config_file"),
         ("ssh", "options"), ("ssh", "options", "ServerAliveInterval"), ("ssh", "reuse"),
         ("nodes",), ("nodes", 0), ("nodes", 0, "host"), ("nodes", 0, "slots"),
         ("nodes", 0, "gpus"), ("nodes", 0, "ssh"), ("nodes", 0, "ssh", "options")]


@pytest.mark.parametrize("path", PATHS, ids=[".".join(map(str, p)) for p in PATHS])
def test_any_shape_anywhere_is_a_spec_error_or_accepted(path: tuple) -> None:
    """Every key of the file given every YAML shape: accepted, or a SpecError (never a
    TypeError, AttributeError, ...)."""
    import yaml

    for shape in SHAPES:
        data: dict = {"nodes": [{"host": "a"}]}
        at = data
        for key in path[:-1]:
            at = at[key] if isinstance(key, int) or key in at else at.setdefault(key, {})
        at[path[-1]] = shape
        try:
            parse_cluster_text(yaml.safe_dump(data), "c.yaml")
        except SpecError:
            pass


@pytest.mark.parametrize("python,refused", [
    ("{repo}/evil.sh", True), ("{repo}/.venv/bin/python", True), ("{repo}/sub/../x", True),
    ("~/{home_repo}/tools/python", True), ("{home_repo}/tools/python", True),
    ("auto", False), ("python3", False), ("/usr/bin/python3", False),
    ("~/.ptcluster/venv/bin/python", False), ("{repo}-other/python", False),
])
def test_a_python_inside_the_cluster_files_directory_needs_trust(python: str, refused: bool,
                                                                  tmp_path) -> None:
    """``python:`` starts every node program: one that the file's own directory (a cloned
    repository) ships is its author's code; a relative path is where ssh's shell finds it
    (from the home directory)."""
    repo, home_repo = tmp_path / "repo", "ptc-unit-clone"
    python = python.format(repo=repo, home_repo=home_repo)
    text = f"nodes: [{{host: a, python: '{python}'}}]\n"
    code_dir = str(repo) if python.startswith("/") else os.path.expanduser(f"~/{home_repo}")
    if refused:
        with pytest.raises(SpecError, match=r"nodes\[0\].python: .*cluster file's own dir.*"
                                            "--trust-cluster-file"):
            parse_cluster_text(text, "c.yaml", code_dir=code_dir)
        assert parse_cluster_text(text, "c.yaml", trusted=True, code_dir=code_dir)
    else:
        assert parse_cluster_text(text, "c.yaml", code_dir=code_dir).nodes[0].python == python


def test_a_cluster_file_in_the_home_directory_may_name_any_interpreter_there() -> None:
    home = os.path.expanduser("~")
    for python in ("~/.ptcluster/venv/bin/python", "venvs/torch/bin/python"):
        text = f"nodes: [{{host: a, python: '{python}'}}]\n"
        assert parse_cluster_text(text, "c.yaml", code_dir=home).nodes[0].python == python
        assert parse_cluster_text(text, "c.yaml", code_dir="/").nodes[0].python == python


def test_doctor_and_bench_ranks_get_no_env_of_an_untrusted_cluster_file(cli, tmp_path,
                                                                       monkeypatch) -> None:
    """M3: doctor's all-reduce and bench run ptcluster's own code in every rank; a cloned
    repository's ``env:`` (``PYTHONPATH``, ``LD_PRELOAD``) reaches them only when the user
    vouches for the file. The spec each command would launch is caught before anything runs."""
    from ptcluster.cli import bench_cmd, doctor_cmd
    from ptcluster.cluster.trust import TRUST_ENV_VAR, TRUST_IT

    (tmp_path / "cluster.yaml").write_text(
        "nodes: [{host: 10.9.9.9, slots: 1}]\n"
        "env: {PYTHONPATH: /repo/evil, LD_PRELOAD: /repo/evil.so}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TRUST_ENV_VAR, raising=False)
    seen: list[tuple[tuple[str, str], ...]] = []

    def caught(spec, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(spec.env)
        raise SystemExit(0)

    monkeypatch.setattr(doctor_cmd, "diagnose", caught)
    monkeypatch.setattr(bench_cmd, "run_bench", caught)
    for args in (["doctor"], ["bench"]):
        code, _, err = cli(*args)
        assert code == 0 and seen[-1] == (), err
        assert err.splitlines()[:2] == [  # the file found, then the note, as it is
            "ptcluster: using the cluster file cluster.yaml (from the current directory)",
            f"ptcluster: {args[0]} leaves out the cluster file's env: (2 variable(s)): its "
            f"ranks run ptcluster's own code. Fix: {TRUST_IT}"], err
    evil = (("PYTHONPATH", "/repo/evil"), ("LD_PRELOAD", "/repo/evil.so"))
    for args in (["doctor", "--trust-cluster-file"], ["bench", "--trust-cluster-file"],
                 ["doctor", "--skip-allreduce"]):  # (vouched for; or no rank runs)
        code, _, err = cli(*args)
        assert code == 0 and seen[-1] == evil and "leaves out" not in err, (args, err)
