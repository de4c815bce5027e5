"""``ptcluster.checkpoint`` without a job: how it is imported, a one-process save and load, and
the checkpoint directory of another user refused. (Real multi-process jobs:
``test_checkpoint.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ptcluster.checkpoint as ckpt
from ptcluster.checkpoint import layout
from ptcluster.node.rank_wire import CKPT_ROOT_VAR


def test_both_imports_work_and_import_ptcluster_stays_without_torch() -> None:
    code = ("import sys, ptcluster; m = ptcluster.checkpoint; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "import ptcluster.checkpoint as c; assert c is m; print(sorted(c.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['last_saved', 'load', 'save', 'wait']"


def test_one_process_saves_and_loads_in_place(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CKPT_ROOT_VAR, str(tmp_path))
    model = torch.nn.Linear(4, 2)
    state = {"model": model, "n": torch.tensor([3])}
    assert ckpt.load(state) is None
    saved = model.weight.detach().clone()
    ckpt.save(state, 7)
    with torch.no_grad():
        model.weight.add_(1.0)  # after save() returned: not in the checkpoint
    assert ckpt.wait() == 7 and ckpt.last_saved() == 7
    fresh = torch.nn.Linear(4, 2)
    state2 = {"model": fresh, "n": torch.tensor([0])}
    assert ckpt.load(state2) == 7
    assert torch.equal(fresh.weight, saved) and state2["n"].item() == 3
    assert layout.read_marker(tmp_path / "ckpt" / "step-7") is not None


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_a_checkpoint_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "ckpt"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PermissionError, match="belongs to uid 65534, not this user"):
        ckpt.save({"x": torch.zeros(1)}, 1, dir=str(theirs))
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        ckpt.load({"x": torch.zeros(1)}, dir=str(theirs))
    assert list(theirs.iterdir()) == []
