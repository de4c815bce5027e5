"""ClusterSpec -> a commented cluster.yaml that loads back to the same spec."""

from __future__ import annotations

import json
import os

from ptcluster.cluster.model import AUTO_PYTHON, ClusterSpec, SshSpec


def _q(value: str) -> str:
    # JSON strings are valid YAML scalars: quoting this way is always safe to load back.
    return json.dumps(value)


def render_cluster_yaml(spec: ClusterSpec) -> str:
    default_python, default_workdir = AUTO_PYTHON, os.getcwd()
    first = spec.nodes[0]
    common_if = first.interface if all(n.interface == first.interface for n in spec.nodes) else None
    common_ssh = first.ssh if all(n.ssh == first.ssh for n in spec.nodes) else SshSpec()
    out = [
        "# ptcluster cluster file. Check it with `ptcluster doctor`, use it with `ptcluster run`.",
        "# Ranks follow the order of nodes: the first node gets ranks 0..slots-1 and hosts the",
        "# rendezvous (`master.addr`: its address on the cluster network, when not `host`).",
        "nodes:",
    ]
    for node in spec.nodes:
        out.append(f"  - host: {_q(node.host)}")
        out.append(f"    slots: {node.slots}        # processes on this node (normally its GPUs)")
        if node.interface != common_if and node.interface is not None:
            out.append(f"    interface: {_q(node.interface)}")
        if node.python != default_python:
            out.append(f"    python: {_q(node.python)}")
        if node.workdir != default_workdir:
            out.append(f"    workdir: {_q(node.workdir)}")
        if node.ssh != common_ssh:
            out.extend("    " + line for line in _ssh_lines(node.ssh))
    out.append("")
    out.append("# Rendezvous host and TCP port, reachable from all nodes. auto: each job takes a "
               "free one on")
    out.append("# the master (29500-29999), so jobs on the same nodes never collide.")
    out.append(f"master: {{addr: {_q(spec.master.addr)}, port: "
               f"{spec.master.port or 'auto'}}}")
    out.append("")
    out.append("# auto: NCCL when every rank has a GPU, else gloo.  auto | nccl | gloo")
    out.append(f"backend: {spec.backend}")
    out.append("")
    out.append("# NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME on every node; detected when absent.")
    out.append(f"interface: {_q(common_if)}" if common_if else "# interface: eth0")
    out.append("")
    out.append("# Interpreter on the nodes (default: the venv `ptcluster setup` makes, where it")
    out.append("# exists, else the head's own path) and working directory (default: the head's).")
    out.append("# python: /opt/venv/bin/python")
    out.append("# workdir: /shared/project")
    out.append("")
    out.append("# The project's own Python environment (a uv.lock, pylock.toml, requirements*.txt")
    out.append("# or pyproject.toml, relative to this file): resolved on this machine, built on")
    out.append("# every node beside setup's torch; the ranks run in it.")
    out.append(f"requirements: {_q(spec.requirements)}" if spec.requirements
               else "# requirements: requirements.txt")
    out.append("")
    out.append("# Passed to every rank; nothing else of this machine's environment is shipped.")
    if spec.env:
        out.append("env:")
        out.extend(f"  {k}: {_q(v)}" for k, v in spec.env)
    else:
        out.append("env: {}            # e.g. {NCCL_DEBUG: WARN}")
    out.append("")
    out.append("# How this machine reaches the nodes (OpenSSH; ~/.ssh/config applies).")
    lines = _ssh_lines(common_ssh)
    out.extend(lines if lines else ["# ssh: {user: ubuntu, port: 22, identity_file: "
                                    "~/.ssh/id_ed25519, options: {ServerAliveInterval: 5}}"])
    return "\n".join(out) + "\n"


def _ssh_lines(ssh: SshSpec) -> list[str]:
    fields = []
    if ssh.user is not None:
        fields.append(f"user: {_q(ssh.user)}")
    if ssh.port is not None:
        fields.append(f"port: {ssh.port}")
    if ssh.identity_file:
        fields.append(f"identity_file: {_q(ssh.identity_file)}")
    if ssh.config_file:
        fields.append(f"config_file: {_q(ssh.config_file)}")
    if ssh.options:
        opts = ", ".join(f"{k}: {_q(v)}" for k, v in ssh.options)
        fields.append(f"options: {{{opts}}}")
    if ssh.reuse is not None:
        fields.append(f"reuse: {ssh.reuse}")
    return [f"ssh: {{{', '.join(fields)}}}"] if fields else []
