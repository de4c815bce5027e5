"""Cluster file, hostfile and --hosts parsing: table-driven, no network."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from ptcluster.cluster import (
    load_cluster_file,
    parse_cluster_text,
    parse_hostfile_text,
    parse_hosts,
    render_cluster_yaml,
)
from ptcluster.errors import SpecError

GOOD = """
nodes:
  - host: 192.168.1.10
    slots: 2
  - host: node2
    slots: 1
    interface: ens33
    python: /opt/other/bin/python
    ssh: {port: 2222, options: {ServerAliveInterval: 3}}
  - host: node3.example.org
master: {addr: 192.168.1.10, port: 29600}
backend: gloo
interface: eth0
python: /opt/venv/bin/python
workdir: /shared/project
env: {NCCL_DEBUG: WARN, OMP_NUM_THREADS: 4, FLAG: true}
ssh:
  user: ubuntu
  port: 22
  identity_file: ~/.ssh/id_ed25519
  options: {ServerAliveInterval: 5, ConnectTimeout: 7}
"""


def test_good_file_loads_with_overrides_and_defaults() -> None:
    spec = parse_cluster_text(GOOD, "c.yaml")
    a, b, c = spec.nodes
    assert [n.host for n in spec.nodes] == ["192.168.1.10", "node2", "node3.example.org"]
    assert [n.slots for n in spec.nodes] == [2, 1, 1]
    assert spec.world_size == 4
    assert (a.interface, b.interface, c.interface) == ("eth0", "ens33", "eth0")
    assert (a.python, b.python) == ("/opt/venv/bin/python", "/opt/other/bin/python")
    assert c.workdir == "/shared/project"
    assert spec.master.addr == "192.168.1.10" and spec.master.port == 29600
    assert spec.backend == "gloo"
    assert spec.env == (("NCCL_DEBUG", "WARN"), ("OMP_NUM_THREADS", "4"), ("FLAG", "1"))
    assert a.ssh.user == "ubuntu" and a.ssh.port == 22
    assert b.ssh.port == 2222 and b.ssh.user == "ubuntu"
    assert dict(b.ssh.options) == {"ServerAliveInterval": "3", "ConnectTimeout": "7"}
    assert [list(spec.ranks_of(i)) for i in range(3)] == [[0, 1], [2], [3]]


def test_spec_is_frozen() -> None:
    spec = parse_cluster_text(GOOD, "c.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.nodes[0].slots = 5  # type: ignore[misc]


def test_defaults_master_is_first_node_port_29500() -> None:
    spec = parse_cluster_text("nodes: [{host: a}, {host: b, slots: 3}]", "c.yaml")
    assert spec.master.addr == "a" and spec.master.port == 29500
    assert spec.backend == "auto" and spec.nodes[0].interface is None
    assert [n.slots for n in spec.nodes] == [1, 3]


BAD = [
    # (id, text, key path in the message, a word of the fix or problem)
    ("empty", "", "", "empty"),
    ("comment-only", "# nothing\n", "", "empty"),
    ("not-mapping", "- a\n- b\n", "", "mapping"),
    ("yaml-syntax", "nodes:\n  - host: a\n   slots: 2\n", "line 3", "YAML syntax"),
    ("yaml-unclosed", "nodes: [{host: a}\n", "line", "YAML syntax"),
    ("duplicate-key", "nodes: [{host: a}]\nbackend: gloo\nbackend: nccl\n", "line 3", "duplicate"),
    ("unknown-top", "nodes: [{host: a}]\nbackends: gloo\n", "backends", "did you mean 'backend'"),
    ("unknown-node-key", "nodes: [{host: a, slot: 2}]\n", "nodes[0].slot", "did you mean 'slots'"),
    ("unknown-master-key", "nodes: [{host: a}]\nmaster: {address: a}\n", "master.address",
     "did you mean 'addr'"),
    ("unknown-ssh-key", "nodes: [{host: a}]\nssh: {usr: x}\n", "ssh.usr", "did you mean 'user'"),
    ("missing-nodes", "backend: gloo\n", "nodes", "missing"),
    ("empty-nodes", "nodes: []\n", "nodes", "non-empty"),
    ("nodes-not-list", "nodes: {host: a}\n", "nodes", "non-empty list"),
    ("node-no-host", "nodes: [{slots: 2}]\n", "nodes[0].host", "missing"),
    ("duplicate-host", "nodes: [{host: a}, {host: b}, {host: A}]\n", "nodes[2].host", "duplicate"),
    ("slots-zero", "nodes: [{host: a, slots: 0}]\n", "nodes[0].slots", ">= 1"),
    ("slots-negative", "nodes: [{host: a, slots: -2}]\n", "nodes[0].slots", ">= 1"),
    ("slots-string", "nodes: [{host: a, slots: two}]\n", "nodes[0].slots", "integer"),
    ("slots-float", "nodes: [{host: a, slots: 1.5}]\n", "nodes[0].slots", "integer"),
    ("slots-bool", "nodes: [{host: a, slots: true}]\n", "nodes[0].slots", "integer"),
    ("port-high", "nodes: [{host: a}]\nmaster: {port: 70000}\n", "master.port", "65535"),
    ("port-zero", "nodes: [{host: a}]\nmaster: {port: 0}\n", "master.port", "between 1"),
    ("port-string", "nodes: [{host: a}]\nmaster: {port: http}\n", "master.port", "integer"),
    ("ssh-port", "nodes: [{host: a}]\nssh: {port: 99999}\n", "ssh.port", "65535"),
    ("backend", "nodes: [{host: a}]\nbackend: mpi\n", "backend", "unknown backend"),
    ("backend-typo", "nodes: [{host: a}]\nbackend: ncl\n", "backend", "did you mean 'nccl'"),
    ("env-bad-name", "nodes: [{host: a}]\nenv: {1BAD: x}\n", "env.1BAD", "variable name"),
    ("env-dash-name", "nodes: [{host: a}]\nenv: {MY-VAR: x}\n", "env.MY-VAR", "variable name"),
    ("env-list-value", "nodes: [{host: a}]\nenv: {A: [1, 2]}\n", "env.A", "string or number"),
    ("env-null-value", "nodes: [{host: a}]\nenv: {A: null}\n", "env.A", "string or number"),
    ("env-map-value", "nodes: [{host: a}]\nenv: {A: {b: 1}}\n", "env.A", "string or number"),
    ("env-not-map", "nodes: [{host: a}]\nenv: [A]\n", "env", "mapping"),
    ("env-reserved", "nodes: [{host: a}]\nenv: {MASTER_PORT: 1}\n", "env.MASTER_PORT",
     "master.port"),
    ("env-ifname", "nodes: [{host: a}]\nenv: {NCCL_SOCKET_IFNAME: eth0}\n",
     "env.NCCL_SOCKET_IFNAME", "interface"),
    ("host-injection", "nodes: [{host: 'node1;touch x'}]\n", "nodes[0].host",
     "not a valid hostname"),
    ("host-space", "nodes: [{host: 'node 1'}]\n", "nodes[0].host", "not a valid hostname"),
    ("host-dollar", "nodes: [{host: '$(reboot)'}]\n", "nodes[0].host", "not a valid hostname"),
    ("host-option", "nodes: [{host: '-oProxyCommand=x'}]\n", "nodes[0].host", "not a valid"),
    ("host-list", "nodes: [{host: [a]}]\n", "nodes[0].host", "not a valid hostname"),
    ("master-addr-bad", "nodes: [{host: a}]\nmaster: {addr: 'a b'}\n", "master.addr",
     "not a valid"),
    ("master-not-first", "nodes: [{host: a}, {host: b}]\nmaster: {addr: b}\n", "master.addr",
     "first node"),
    ("master-loopback", "nodes: [{host: a}, {host: b}]\nmaster: {addr: 127.0.0.1}\n",
     "master.addr", "loopback"),
    ("master-localhost", "nodes: [{host: a}, {host: b}]\nmaster: {addr: localhost}\n",
     "master.addr", "cannot reach"),
    ("interface-bad", "nodes: [{host: a}]\ninterface: 'eth0; ls'\n", "interface", "interface name"),
    ("node-interface-long", "nodes: [{host: a, interface: averyveryverylongname}]\n",
     "nodes[0].interface", "interface name"),
    ("python-empty", "nodes: [{host: a}]\npython: ''\n", "python", "non-empty"),
    ("workdir-list", "nodes: [{host: a}]\nworkdir: [x]\n", "workdir", "non-empty string"),
    ("ssh-user-bad", "nodes: [{host: a}]\nssh: {user: 'root;id'}\n", "ssh.user", "user name"),
    ("ssh-option-name", "nodes: [{host: a}]\nssh: {options: {'Bad Opt': 1}}\n",
     "ssh.options.Bad Opt", "ssh option"),
    ("node-ssh-unknown", "nodes: [{host: a, ssh: {pot: 2}}]\n", "nodes[0].ssh.pot",
     "did you mean 'port'"),
    ("node-not-mapping", "nodes: [[a, b]]\n", "nodes[0]", "mapping"),
    ("node-string-bad-slots", "nodes: ['a:x']\n", "nodes[0]", "not an integer"),
]


@pytest.mark.parametrize("text,path,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_cluster_files_name_file_path_and_fix(text: str, path: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_cluster_text(text, "bad.yaml")
    message = str(info.value)
    assert message.startswith("bad.yaml"), message
    assert path in message, message
    assert words.lower() in message.lower(), message
    assert "Fix:" in message, message
    assert "\n" not in message


def test_missing_file_is_a_spec_error(tmp_path) -> None:
    with pytest.raises(SpecError, match="not found"):
        load_cluster_file(tmp_path / "nope.yaml")


def test_injection_host_never_runs_anything(tmp_path) -> None:
    marker = tmp_path / "x"
    with pytest.raises(SpecError):
        parse_cluster_text(f"nodes: [{{host: 'n;touch {marker}'}}]", "c.yaml")
    assert not marker.exists()


@pytest.mark.parametrize("text,expected", [
    ("h1:2,h2:1", [("h1", 2), ("h2", 1)]),
    ("h1,h2,h3", [("h1", 1), ("h2", 1), ("h3", 1)]),
    ("10.0.0.1:4", [("10.0.0.1", 4)]),
    ("[fe80::1]:2,h", [("fe80::1", 2), ("h", 1)]),
    (" a:1 , b:2 ", [("a", 1), ("b", 2)]),
])
def test_hosts_option(text: str, expected: list[tuple[str, int]]) -> None:
    spec = parse_hosts(text)
    assert [(n.host, n.slots) for n in spec.nodes] == expected


@pytest.mark.parametrize("text,words", [
    ("", "no hosts"), ("a:0", ">= 1"), ("a:x", "not an integer"), ("a;b:1", "not a valid"),
    ("a:1,a:2", "duplicate"),
])
def test_bad_hosts_option(text: str, words: str) -> None:
    with pytest.raises(SpecError, match=words):
        parse_hosts(text)


def test_hostfile() -> None:
    text = textwrap.dedent("""\
        # DeepSpeed style
        worker-1 slots=4
        worker-2 slots=2   # comment
        10.0.0.3
        worker-4 slots=1 max_slots=8
    """)
    spec = parse_hostfile_text(text, "hostfile")
    assert [(n.host, n.slots) for n in spec.nodes] == [
        ("worker-1", 4), ("worker-2", 2), ("10.0.0.3", 1), ("worker-4", 1)]


@pytest.mark.parametrize("text,words", [
    ("w1 slots=x\n", "line 1"), ("w1 cpus=2\n", "unexpected"), ("# only\n", "no hosts"),
    ("w1\nw1\n", "duplicate"), ("w;1 slots=1\n", "not a valid"),
])
def test_bad_hostfile(text: str, words: str) -> None:
    with pytest.raises(SpecError, match=words):
        parse_hostfile_text(text, "hostfile")


def test_render_round_trips() -> None:
    for spec in (parse_hosts("a:2,b:1,c:1"), parse_cluster_text(GOOD, "c.yaml"),
                 parse_hostfile_text("x slots=3\ny\n", "hf")):
        text = render_cluster_yaml(spec)
        assert "#" in text  # commented
        back = parse_cluster_text(text, spec.source)
        assert back == spec


def test_how_the_head_reaches_the_nodes_is_one_derived_value() -> None:
    from ptcluster.cluster import local_cluster
    from ptcluster.cluster.model import Reach
    from ptcluster.remote.connect import transports
    from ptcluster.remote.slurm import SrunTransport
    from ptcluster.remote.transport import LocalTransport, SshTransport

    ssh = parse_cluster_text("nodes:\n  - {host: n1, slots: 1}\n", "c.yaml")
    alloc = dataclasses.replace(ssh, slurm_job="42")
    local = local_cluster(1)
    assert [s.reach for s in (ssh, alloc, local)] == [Reach.SSH, Reach.SRUN, Reach.LOCAL]
    assert isinstance(transports(ssh)["n1"], SshTransport)
    assert isinstance(transports(alloc)["n1"], SrunTransport)
    assert all(isinstance(t, LocalTransport) for t in transports(local).values())


def test_project_keys_are_read_without_nodes(tmp_path) -> None:
    """Inside a Slurm allocation only a cluster file's project keys apply (the nodes are
    Slurm's): a file with no ``nodes:`` gives them, paths from the file's folder, and the trust
    rule of ``data:`` holds as in a full file."""
    from ptcluster.cluster.load import load_project_keys

    path = tmp_path / "cluster.yaml"
    path.write_text("requirements: req.txt\nfind_links: [wheels]\n"
                    "data: [{name: train, src: data/train, dest: /scratch/train}]\n")
    keys = load_project_keys(str(path), trusted=True)
    assert keys["requirements"] == str(tmp_path / "req.txt")
    assert keys["find_links"] == (str(tmp_path / "wheels"),)
    (entry,) = keys["data"]
    assert (entry.name, entry.src, entry.dest) == ("TRAIN", str(tmp_path / "data/train"),
                                                    "/scratch/train")
    with pytest.raises(SpecError, match="data:.*trust"):
        load_project_keys(str(path), trusted=False)
    path.write_text("nodes: [{host: n1}]\nrequirement: req.txt\n")
    with pytest.raises(SpecError, match="requirement"):
        load_project_keys(str(path), trusted=True)
    path.write_text("nodes: [{host: n1}]\n")
    assert load_project_keys(str(path)) == {"requirements": None, "find_links": (), "data": ()}
    path.write_text("")
    assert load_project_keys(str(path)) == {}
