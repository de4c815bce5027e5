"""The head -> rank environment contract: every variable ptcluster sets for a rank is named once,
in ``node.rank_wire``, and every end (the plan, the guard, the shim, the stack probe, the rank
API, the reference trainer) uses that name."""

from __future__ import annotations

import ast
from pathlib import Path

import ptcluster
from ptcluster.node import rank_wire

SRC = Path(ptcluster.__file__).parent
OURS = {value for name, value in vars(rank_wire).items()
        if name.endswith("_VAR") and isinstance(value, str)} | \
    {torch_name for _, torch_name in rank_wire.ELASTIC_VARS}


def test_the_contract_names_what_it_must() -> None:
    assert {"PTCLUSTER_JOB_ID", "PTCLUSTER_ATTEMPT", "PTCLUSTER_MAX_RESTARTS", "PTCLUSTER_BACKEND",
            "PTCLUSTER_STRAGGLER", "PTCLUSTER_GUARD_SOCK", "PTCLUSTER_SHIM",
            "TORCH_FR_BUFFER_SIZE", "TORCHELASTIC_RESTART_COUNT"} <= OURS


def test_no_rank_variable_is_spelled_outside_rank_wire() -> None:
    """A string literal equal to a rank variable's name anywhere else in the package is a second
    spelling (docstrings that mention one are not literals equal to it)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path == Path(rank_wire.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in OURS:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.value}")
    assert found == [], found
