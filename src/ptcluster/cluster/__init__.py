"""Cluster file -> validated, frozen :class:`ClusterSpec`."""

from __future__ import annotations

from ptcluster.cluster.load import (
    find_cluster_file,
    load_cluster_file,
    load_hostfile,
    local_cluster,
    parse_cluster_text,
    parse_hostfile_text,
    parse_hosts,
)
from ptcluster.cluster.model import ClusterSpec, MasterSpec, NodeSpec, SshSpec
from ptcluster.cluster.render import render_cluster_yaml

__all__ = [
    "ClusterSpec", "MasterSpec", "NodeSpec", "SshSpec", "find_cluster_file", "load_cluster_file",
    "load_hostfile", "local_cluster", "parse_cluster_text", "parse_hostfile_text", "parse_hosts",
    "render_cluster_yaml",
]
