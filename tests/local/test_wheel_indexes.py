"""The head's wheel download (L8), real pip against two local indexes: torch and its
dependencies come from PyTorch's index alone, so a name of that index that someone registered
on "PyPI" with a higher version (the torchtriton pattern) is never picked, neither for torch
nor when ptcluster's own dependencies are resolved afterwards."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import pytest

from ptcluster.setup import torch_choice, wheels
from ptcluster.setup.torch_choice import TorchChoice


def wheel(index: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure wheel of ``name`` in ``index/name/`` and that folder's PEP 503 page."""
    folder = index / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    links = "".join(f'<a href="{p.name}">{p.name}</a>\n' for p in sorted(folder.glob("*.whl")))
    (folder / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    return path


@pytest.fixture
def indexes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    torch_index, pypi = tmp_path / "torch-cpu", tmp_path / "pypi"
    wheel(torch_index, "torch", "2.0.0+cpu", ("tritonx>=1.0",))
    wheel(torch_index, "tritonx", "1.0")
    wheel(pypi, "tritonx", "9.0")  # (someone registered the name on "PyPI")
    wheel(pypi, "dep", "1.0")
    monkeypatch.setattr(torch_choice, "INDEX", f"file://{tmp_path}/torch-{{variant}}/")
    for name in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # (no pip.conf of this machine)
    monkeypatch.setenv("PIP_INDEX_URL", f"file://{pypi}/")
    return torch_index, pypi


def test_torchs_dependencies_come_from_its_index_alone(indexes: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    me = wheel(tmp_path / "mine", "ptcluster", "9.9", ("torch>=2.0", "dep>=1.0"))
    folder = tmp_path / "wh"
    folder.mkdir()
    said: list[str] = []
    wheels.download(folder, TorchChoice("2.0.0", "cpu", "test"), me, 300, said.append)
    got = sorted(p.name for p in folder.glob("*.whl"))
    assert got == ["dep-1.0-py3-none-any.whl", "ptcluster-9.9-py3-none-any.whl",
                   "torch-2.0.0+cpu-py3-none-any.whl", "tritonx-1.0-py3-none-any.whl"], got
    assert sys.executable  # (pip is this interpreter's)


def test_pins_keep_a_name_to_what_the_folder_holds(tmp_path: Path) -> None:
    for name in ("a-1.0-py3-none-any.whl", "a-1.2-py3-none-any.whl", "b_c-2.0-py3-none-any.whl",
                 "ptcluster-9.9-py3-none-any.whl", "torch-2.0.0+cpu-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    assert wheels.pin_text(tmp_path) == "a>=1.0,<=1.2\nb-c==2.0\ntorch==2.0.0+cpu\n"
