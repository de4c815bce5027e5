"""In-process CLI tests: (exit code, stdout, stderr)."""

from __future__ import annotations

import json
import shlex

from ptcluster.spec import load_cluster_file, parse_hosts

CLUSTER = "nodes:\n  - {host: n1, slots: 2}\n  - {host: n2, slots: 1, interface: ens4}\n" \
          "interface: eth0\nenv: {NCCL_DEBUG: WARN, ODD: \"it's $HOME\"}\n"


def test_env_prints_exports_per_node(cli, tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(CLUSTER)
    code, out, _ = cli("env", "--cluster", str(f))
    assert code == 0
    blocks = [b for b in out.strip().split("\n\n")]
    assert len(blocks) == 2
    exports = {}
    for line in blocks[1].splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            exports[key] = shlex.split(value)[0]
    assert exports["WORLD_SIZE"] == "3" and exports["NODE_RANK"] == "1"
    assert exports["MASTER_ADDR"] == "n1" and exports["MASTER_PORT"] == "29500"
    assert exports["NCCL_SOCKET_IFNAME"] == "ens4"
    assert exports["ODD"] == "it's $HOME"
    assert "ranks 2..2" in blocks[1]


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
    assert code == 0 and "world size 4" in out
    spec = load_cluster_file(out_file)
    assert [(n.host, n.slots) for n in spec.nodes] == [("a", 2), ("b", 1), ("c", 1)]
    assert spec.nodes == parse_hosts("a:2,b:1,c:1").nodes
    code, _, err = cli("init", "--hosts", "a", "-o", str(out_file))
    assert code == 2 and "--force" in err


def test_init_hostfile(cli, tmp_path) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text("w1 slots=4\nw2 slots=4 # x\n")
    code, out, _ = cli("init", "--hostfile", str(hf), "-o", "-")
    assert code == 0 and "host: \"w1\"" in out and "slots: 4" in out


def test_run_usage_errors(cli, tmp_path) -> None:
    code, _, err = cli("run")
    assert code == 2 and "nothing to run" in err
    f = tmp_path / "c.yaml"
    f.write_text("nodes: [{host: a}]\n")
    code, _, err = cli("run", "--cluster", str(f), "--nproc", "2", "x.py")
    assert code == 2 and "slots" in err
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
