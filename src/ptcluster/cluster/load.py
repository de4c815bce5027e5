"""Cluster file, hostfile and ``--hosts`` -> :class:`ClusterSpec`.

All validation happens here, at the boundary; the rest of the code trusts the spec.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from ptcluster.cluster.keys import keys_at
from ptcluster.cluster.model import (
    AUTO_PYTHON,
    BACKENDS,
    DEFAULT_MASTER_PORT,
    WARM_IDLE,
    ClusterSpec,
    DataSpec,
    MasterSpec,
    NodeSpec,
    SlurmSetupSpec,
    SshSpec,
)
from ptcluster.cluster.trust import (
    TRUST_IT,
    config_file_risk,
    data_risk,
    python_risk,
    ssh_option_risk,
)
from ptcluster.cluster.validate import Reader, did_you_mean
from ptcluster.errors import SpecError

# the keys each mapping may hold, from the one table that also documents them
TOP_KEYS = keys_at("")
NODE_KEYS = keys_at("nodes[]")
MASTER_KEYS = keys_at("master")
SLURM_KEYS = keys_at("slurm")
SSH_KEYS = keys_at("ssh")
DATA_KEYS = keys_at("data[]")
_DATA_NAME = re.compile(r"^[A-Za-z0-9_]+$")
assert keys_at("nodes[].ssh") == SSH_KEYS, "a node's ssh takes the cluster-wide ssh's keys"
assert keys_at("spares[]") == NODE_KEYS, "a spare takes the keys of a node"

CLUSTER_ENV_VAR = "PTCLUSTER_CLUSTER"
DEFAULT_CLUSTER_FILE = "cluster.yaml"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):  # (PyYAML's own check comes too late)
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a name, not a {key_node.id}", key_node.start_mark)
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_cluster_text(text: str, source: str, trusted: bool = False,
                       code_dir: str | None = None) -> ClusterSpec:
    """Parse and validate cluster-file text; ``source`` names it in errors. Unless ``trusted``
    (the user vouched for the file), settings that would run a program on this machine or
    weaken ssh's host-key checks are refused, and so is a ``python:`` inside ``code_dir`` (the
    file's own directory) (``cluster.trust``)."""
    data = _yaml(text, source)
    if data is None:
        raise SpecError(source, "", "the file is empty",
                        "describe at least `nodes:`; `ptcluster init --hosts h1:2,h2:2` writes one")
    return spec_from_data(data, source, trusted, code_dir)


def _yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = f"line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(source, line, f"YAML syntax error: {problem}",
                        "fix the YAML at that line (indentation, a missing ':' or quote)") from None


PROJECT_KEYS = ("requirements", "find_links", "data")
"""What a cluster file found inside a Slurm allocation gives (:func:`load_project_keys`)."""


def load_project_keys(path: str, trusted: bool = False) -> dict[str, Any]:
    """``requirements:``, ``find_links:`` and ``data:`` of the cluster file at ``path`` (as
    ClusterSpec's fields, checked as :func:`load_cluster_file` checks them; every other key
    must be a known one and is not used). Inside a Slurm allocation the nodes are Slurm's,
    and a file kept for Slurm need not list any: ``nodes:`` is not required here."""
    data = _yaml(_read(path, "cluster file"), path)
    if data is None:
        return {}
    r = Reader(path, trusted, os.path.dirname(os.path.abspath(path)))
    said = _environment(r, r.mapping(data, "", TOP_KEYS))
    return {k: said[k] for k in PROJECT_KEYS}  # (warm pools are not used under Slurm)


def spec_from_data(data: Any, source: str, trusted: bool = False,
                   code_dir: str | None = None) -> ClusterSpec:
    r = Reader(source, trusted, code_dir)
    top = r.mapping(data, "", TOP_KEYS)
    raw_nodes = top.get("nodes")
    if raw_nodes is None:
        raise r.fail("nodes", "is missing",
                     "add `nodes:` with one `- host: NAME` entry per machine")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise r.fail("nodes", "must be a non-empty list of nodes",
                     "add one `- host: NAME` entry per machine")

    backend = top.get("backend", "auto")
    if backend not in BACKENDS:
        raise r.fail("backend", f"unknown backend {backend!r}",
                     did_you_mean(str(backend), BACKENDS))
    interface = r.interface(top["interface"], "interface") if "interface" in top else None
    python = _python(r, top["python"], "python", "the interpreter path on the nodes") \
        if "python" in top else AUTO_PYTHON
    workdir = r.text(top["workdir"], "workdir", "a directory present on every node") \
        if "workdir" in top else os.getcwd()
    ssh = _ssh(r, top["ssh"], "ssh") if "ssh" in top else SshSpec()
    env = r.env(top.get("env"), "env")
    gpus = _gpus(r, top["gpus"], "gpus") if "gpus" in top else None

    base = NodeSpec(host="", interface=interface, python=python, workdir=workdir, ssh=ssh,
                    gpus=gpus)
    nodes = _machines(r, raw_nodes, "nodes", base, {})
    spares = _spares(r, top.get("spares"), base, {n.host.lower(): f"nodes[{i}]"
                                                   for i, n in enumerate(nodes)})
    return ClusterSpec(nodes=tuple(nodes), master=_master(r, top.get("master"), nodes),
                       backend=backend, env=env, source=source, **_environment(r, top),
                       spares=spares,
                       slurm=_slurm(r, top["slurm"], nodes) if "slurm" in top else None)


def _machines(r: Reader, raw: list[Any], key: str, base: NodeSpec,
              seen: dict[str, str]) -> list[NodeSpec]:
    """The entries of ``nodes:`` (or ``spares:``): each machine once (``seen``: the hosts
    already named, lower-cased, with where), every per-node key over the cluster-wide
    ``base``."""
    out: list[NodeSpec] = []
    for i, item in enumerate(raw):
        path = f"{key}[{i}]"
        if isinstance(item, str):
            host, slots = _host_slots(r, item, path)
            item = {"host": host, "slots": slots}
        node = r.mapping(item, path, NODE_KEYS)
        if "host" not in node:
            raise r.fail(f"{path}.host", "is missing", f"add `host: NAME` to this {key[:-1]}")
        host = r.host(node["host"], f"{path}.host")
        if host.lower() in seen:
            raise r.fail(f"{path}.host", f"duplicate host {host!r} (also {seen[host.lower()]})",
                         "list every machine once (as a node or as a spare, not both); give "
                         "a node more slots instead")
        seen[host.lower()] = path
        out.append(replace(
            base, host=host, slots=r.slots(node.get("slots", 1), f"{path}.slots"),
            interface=r.interface(node["interface"], f"{path}.interface")
            if "interface" in node else base.interface,
            python=_python(r, node["python"], f"{path}.python",
                           "the interpreter path on this node") if "python" in node
            else base.python,
            workdir=r.text(node["workdir"], f"{path}.workdir", "a directory on this node")
            if "workdir" in node else base.workdir,
            ssh=base.ssh.merged(_ssh(r, node["ssh"], f"{path}.ssh")) if "ssh" in node
            else base.ssh,
            gpus=_gpus(r, node["gpus"], f"{path}.gpus") if "gpus" in node else base.gpus))
        gpus = out[-1].gpus
        if isinstance(gpus, tuple) and len(gpus) < out[-1].slots:
            raise r.fail(f"{path}.gpus", f"lists {len(gpus)} GPU(s) for {out[-1].slots} "
                         "slot(s)", "list at least one GPU per slot, or use gpus: auto")
    return out


def _spares(r: Reader, value: Any, base: NodeSpec, seen: dict[str, str]) -> tuple[NodeSpec, ...]:
    """``spares:``: machines shaped like ``nodes:`` entries that run no rank until a restart
    puts one in a lost or refused node's place (``launch.supervise.restart``)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise r.fail("spares", f"must be a list of machines like `nodes:`, got {value!r}",
                     "e.g. spares: [{host: node5, slots: 2}]")
    return tuple(_machines(r, value, "spares", base, seen))


def _environment(r: Reader, top: dict[str, Any]) -> dict[str, Any]:
    """``requirements:`` and ``find_links:``, as ClusterSpec's fields."""
    what = "a uv.lock, pylock.toml, requirements*.txt or pyproject.toml path"
    return {"requirements": _here(r, r.text(top["requirements"], "requirements", what))
            if "requirements" in top else None,
            "find_links": _find_links(r, top.get("find_links")),
            "data": _data(r, top["data"]) if "data" in top else (),
            **_warm(r, top)}


MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _warm(r: Reader, top: dict[str, Any]) -> dict[str, Any]:
    """``warm:`` (true, false or the idle seconds) and ``warm_imports:``."""
    value, warm = top.get("warm", False), None
    if value is True:
        warm = WARM_IDLE
    elif value is not False:
        warm = float(r.integer(value, "warm", 1, 604800, "use true, false or the pool's idle "
                               "timeout in seconds, e.g. warm: 900"))
    names = top.get("warm_imports", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and MODULE.fullmatch(n)
                                              for n in names):
        raise r.fail("warm_imports", f"must be a list of module names, got {names!r}",
                     "e.g. warm_imports: [numpy, transformers]")
    return {"warm": warm, "warm_imports": tuple(names)}


def _data(r: Reader, value: Any) -> tuple[DataSpec, ...]:
    """``data:``: a list of ``{name, src, dest}``, refused from a file not vouched for."""
    if not r.trusted:
        raise r.fail("data", data_risk(), f"{TRUST_IT}; else push with `ptcluster push`")
    if not isinstance(value, list):
        raise r.fail("data", f"must be a list of {{name, src, dest}}, got {value!r}",
                     "e.g. data: [{name: train, src: data/train}]")
    out: list[DataSpec] = []
    for i, raw in enumerate(value):
        path = f"data[{i}]"
        entry = r.mapping(raw, path, DATA_KEYS)
        name = r.text(entry.get("name"), f"{path}.name", "letters, digits and _")
        if not _DATA_NAME.match(name) or name.upper() in {d.name for d in out}:
            raise r.fail(f"{path}.name", f"{name!r} is not a new name of letters, digits and _",
                         "name each entry once, e.g. name: train")
        src = _here(r, r.text(entry.get("src"), f"{path}.src", "a folder on the head"))
        dest = r.text(entry["dest"], f"{path}.dest", "an absolute folder on the nodes") \
            if "dest" in entry else os.path.abspath(src)
        if not dest.startswith("/"):
            raise r.fail(f"{path}.dest", f"{dest!r} is not an absolute path",
                         "e.g. dest: /data/train")
        out.append(DataSpec(name.upper(), os.path.abspath(src), dest))
    return tuple(out)


def _here(r: Reader, path: str) -> str:
    """``path`` as the cluster file means it: relative to the file's own folder."""
    return os.path.join(r.code_dir or os.getcwd(), os.path.expanduser(path))


def _find_links(r: Reader, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise r.fail("find_links", f"must be a list of folders, got {value!r}",
                     "e.g. find_links: [wheels/]")
    return tuple(_here(r, v) for v in value)


def _slurm(r: Reader, value: Any, nodes: list[NodeSpec]) -> SlurmSetupSpec:
    """``slurm:`` (``{}`` or ``true``: the defaults): the controller and partitions must name
    nodes of the file."""
    raw = r.mapping({} if value is True or value is None else value, "slurm", SLURM_KEYS)
    hosts = [n.host for n in nodes]

    def node(v: Any, path: str) -> str:
        if v not in hosts:
            raise r.fail(path, f"{v!r} is not a node of this file",
                         f"name one of: {', '.join(hosts)}")
        return str(v)

    controller = node(raw["controller"], "slurm.controller") if "controller" in raw else hosts[0]
    parts: list[tuple[str, tuple[str, ...]]] = []
    given = raw.get("partitions") or {}
    names = tuple(str(k) for k in given) if isinstance(given, dict) else ()
    for name, members in r.mapping(given, "slurm.partitions", names).items():
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", str(name)):
            raise r.fail(f"slurm.partitions.{name}", "is not a Slurm partition name",
                         "use letters, digits, '_' and '-'")
        if not isinstance(members, list) or not members:
            raise r.fail(f"slurm.partitions.{name}", "must list nodes", "e.g. [node1, node2]")
        parts.append((str(name), tuple(node(m, f"slurm.partitions.{name}") for m in members)))
    return SlurmSetupSpec(controller=controller, partitions=tuple(parts))


def _python(r: Reader, value: Any, path: str, what: str) -> str:
    python = r.text(value, path, what)
    why = "" if r.trusted or r.code_dir is None else python_risk(python, r.code_dir)
    if why:
        raise r.fail(path, why, f"{TRUST_IT}; else name an interpreter outside it")
    return python


def _gpus(r: Reader, value: Any, path: str) -> tuple[int, ...] | str:
    """``gpus:``: auto, or a list of distinct GPU indices."""
    if value == "auto":
        return "auto"
    if not isinstance(value, list) or not value or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise r.fail(path, f"must be auto or a list of GPU indices, got {value!r}",
                     "e.g. gpus: [0, 1] or gpus: auto")
    if len(set(value)) != len(value):
        raise r.fail(path, f"lists a GPU twice: {value}", "list each GPU once")
    return tuple(value)


def _master(r: Reader, value: Any, nodes: list[NodeSpec]) -> MasterSpec:
    """``master:``, defaulting to the first node; it must be that node and reachable."""
    master_raw = r.mapping(value or {}, "master", MASTER_KEYS)
    master = MasterSpec(
        addr=r.host(master_raw["addr"], "master.addr") if "addr" in master_raw else nodes[0].host,
        port=None if master_raw.get("port") == "auto" else
        r.port(master_raw["port"], "master.port") if "port" in master_raw else DEFAULT_MASTER_PORT,
    )
    if len(nodes) > 1 and _loopback(master.addr):
        raise r.fail("master.addr", f"{master.addr!r} is this machine's loopback, which the "
                     "other nodes cannot reach", "set master.addr to the first node's address "
                     "on the cluster network, or drop master.addr")
    for i, other in enumerate(nodes[1:], start=1):
        if other.host.lower() == master.addr.lower():
            raise r.fail("master.addr", f"{master.addr!r} is nodes[{i}], but the rendezvous runs "
                         "on the first node (node rank 0, ranks 0..)",
                         f"move {master.addr} to the top of `nodes`, or drop master.addr")
    return master


def _loopback(addr: str) -> bool:
    low = addr.lower()
    return low in ("localhost", "::1", "ip6-localhost") or low.startswith("127.")


def _ssh(r: Reader, value: Any, path: str) -> SshSpec:
    raw = r.mapping(value or {}, path, SSH_KEYS)
    spec = SshSpec(
        user=r.user(raw["user"], f"{path}.user") if "user" in raw else None,
        port=r.port(raw["port"], f"{path}.port") if "port" in raw else None,
        identity_file=r.text(raw["identity_file"], f"{path}.identity_file", "a private key path")
        if "identity_file" in raw else None,
        config_file=r.text(raw["config_file"], f"{path}.config_file", "an ssh config path")
        if "config_file" in raw else None,
        options=r.ssh_options(raw.get("options"), f"{path}.options"),
        reuse=r.integer(raw["reuse"], f"{path}.reuse", 0, 86400, "give the seconds an idle "
                        "connection is kept (0: none)") if "reuse" in raw else None,
    )
    if not r.trusted:
        risks = [(f"{path}.options.{k}", ssh_option_risk(k, v)) for k, v in spec.options]
        if spec.config_file:
            risks.append((f"{path}.config_file", config_file_risk(spec.config_file)))
        for key, why in risks:
            if why:
                raise r.fail(key, f"{why}: a cluster file may set it only when you trust the "
                             "file (one in the current directory is read by every command)",
                             f"{TRUST_IT}; else put the setting in your own ~/.ssh/config")
    return spec


_BRACKETED = re.compile(r"^\[(?P<host>[^\]]+)\](?::(?P<slots>.*))?$")


def _host_slots(r: Reader, item: str, path: str) -> tuple[str, int]:
    """``host``, ``host:N`` or ``[v6addr]:N`` -> (host, slots)."""
    item = item.strip()
    m = _BRACKETED.match(item)
    if m:
        host, slots_text = m.group("host"), m.group("slots")
    elif item.count(":") == 1:
        host, slots_text = item.split(":")
    else:
        host, slots_text = item, None
    host = r.host(host, path)
    if slots_text is None:
        return host, 1
    if not slots_text.strip().isdigit():
        raise r.fail(path, f"slots {slots_text!r} in {item!r} is not an integer",
                     "write HOST:SLOTS, e.g. node1:2")
    return host, r.slots(int(slots_text), path)


def parse_hosts(text: str) -> ClusterSpec:
    """``--hosts h1:2,h2:1`` -> spec (other settings at their defaults)."""
    r = Reader("--hosts")
    items = [s for s in text.split(",") if s.strip()]
    if not items:
        raise r.fail("", "no hosts given", "write --hosts h1:2,h2:1")
    nodes = [dict(zip(("host", "slots"), _host_slots(r, s, f"[{i}]"), strict=True)) for i, s in
             enumerate(items)]
    return spec_from_data({"nodes": nodes}, "--hosts")


def parse_hostfile_text(text: str, source: str) -> ClusterSpec:
    """DeepSpeed/OpenMPI hostfile: ``host slots=N`` lines, ``#`` comments."""
    r = Reader(source)
    nodes: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        path = f"line {lineno}"
        host, *fields = line.split()
        node: dict[str, Any] = {"host": r.host(host, path), "slots": 1}
        for field_ in fields:
            key, sep, value = field_.partition("=")
            if not sep or key not in ("slots", "max_slots", "max-slots"):
                raise r.fail(path, f"unexpected {field_!r}", "write `HOST slots=N`")
            if not value.isdigit():
                raise r.fail(path, f"{key}={value!r} is not an integer", "write `HOST slots=N`")
            if key == "slots":
                node["slots"] = r.slots(int(value), path)
        nodes.append(node)
    if not nodes:
        raise r.fail("", "no hosts in the hostfile", "add `HOST slots=N` lines")
    try:
        return spec_from_data({"nodes": nodes}, source)
    except SpecError as exc:  # report hostfile lines, not synthetic key paths
        raise SpecError(source, "", exc.detail, exc.fix) from None


def _read(path: str | os.PathLike[str], what: str) -> str:
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(str(p), "", f"{what} not found",
                        "check the path, or write one with `ptcluster init`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(str(p), "", f"cannot read the {what}: {exc}", "check the file") from None


def load_cluster_file(path: str | os.PathLike[str], trusted: bool = False) -> ClusterSpec:
    """The cluster file at ``path`` (``trusted``: see :func:`parse_cluster_text`)."""
    return parse_cluster_text(_read(path, "cluster file"), str(path), trusted,
                              os.path.dirname(os.path.abspath(path)))


def load_hostfile(path: str | os.PathLike[str]) -> ClusterSpec:
    return parse_hostfile_text(_read(path, "hostfile"), str(path))


def local_cluster(nproc: int) -> ClusterSpec:
    """This machine alone, reached without ssh; rendezvous on loopback on a free port."""
    node = NodeSpec(host="localhost", slots=nproc, interface="lo",
                    python=sys.executable, workdir=os.getcwd())
    return ClusterSpec(nodes=(node,), master=MasterSpec(addr="127.0.0.1", port=None),
                       source="<local>", local=True)


def find_cluster_file(explicit: str | None) -> str | None:
    """The cluster file to use: ``--cluster``, else ./cluster.yaml, else $PTCLUSTER_CLUSTER."""
    if explicit:
        return explicit
    if Path(DEFAULT_CLUSTER_FILE).is_file():
        return DEFAULT_CLUSTER_FILE
    return os.environ.get(CLUSTER_ENV_VAR) or None
