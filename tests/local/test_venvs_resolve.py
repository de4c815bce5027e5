"""The project's environment, head side, with the real tools: uv resolves (``uv pip compile``),
pip downloads, wheels land in the store by digest. No network: every wheel is made here and
found through ``--find-links`` (or pip's own configuration, pointed at a folder)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ptcluster.errors import UsageError
from ptcluster.venvs.resolve import resolve
from ptcluster.venvs.resolved import Platform
from ptcluster.venvs.store import WheelStore
from ptcluster.venvs.tools import head_uv_version
from tests.support import wheelmaker
from tests.support.wheelmaker import make_wheel, sha256_of

uv_folder = wheelmaker.uv_folder  # the fixture

HERE = Platform(f"{sys.version_info[0]}.{sys.version_info[1]}", os.uname().machine, "2.36")


@pytest.fixture
def links(tmp_path: Path, uv_folder: Path) -> Path:
    folder = tmp_path / "links"
    make_wheel(folder, "alpha", "1.0", requires=["beta>=2"])
    make_wheel(folder, "beta", "2.1")
    make_wheel(folder, "beta", "1.0")
    make_wheel(folder, "needs-torch", "0.3", requires=["torch>=2", "triton"])
    for wheel in uv_folder.iterdir():
        os.link(wheel, folder / wheel.name)
    return folder


@pytest.fixture(autouse=True)
def no_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """pip and uv reach no index and read no configuration of this machine's."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    monkeypatch.setenv("UV_NO_CONFIG", "1")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    yield


def test_requirements_resolved_by_uv_stored_by_digest_and_cached(tmp_path: Path,
                                                                links: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("alpha\nneeds_torch\n")
    store = WheelStore(tmp_path / "store")
    env = resolve(req, HERE, find_links=[links], refresh=False, store=store, trusted=False)
    assert [(w.name, w.version) for w in env.wheels] == [
        ("alpha", "1.0"), ("beta", "2.1"), ("needs-torch", "0.3")]  # torch, triton: setup's
    for wheel in env.wheels:
        assert store.path(wheel).read_bytes() == (links / wheel.filename).read_bytes()
        assert wheel.sha256 == sha256_of(links / wheel.filename)
    assert [(t.name, t.version) for t in env.tools] == [("uv", head_uv_version())]
    assert store.has(env.tools[0].sha256) and env.source == str(req)

    for wheel in links.iterdir():  # cached by the file's content: no wheel, no uv needed again
        wheel.unlink()
    again = resolve(req, HERE, find_links=[links], refresh=False, store=store, trusted=False)
    assert again == env
    req.write_text("alpha\n")  # another content: resolved anew, and the folder is empty now
    with pytest.raises(UsageError, match="alpha was not found"):
        resolve(req, HERE, find_links=[links], refresh=False, store=store, trusted=False)


def test_refresh_resolves_again(tmp_path: Path, links: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("alpha\n")
    store = WheelStore(tmp_path / "store")
    first = resolve(req, HERE, find_links=[links], refresh=False, store=store, trusted=False)
    make_wheel(links, "beta", "2.2")
    cached = resolve(req, HERE, find_links=[links], refresh=False, store=store, trusted=False)
    assert cached.digest == first.digest
    fresh = resolve(req, HERE, find_links=[links], refresh=True, store=store, trusted=False)
    assert ("beta", "2.2") in [(w.name, w.version) for w in fresh.wheels]
    assert fresh.digest != first.digest


def test_pyproject_and_uv_lock_give_the_same_environment(tmp_path: Path, links: Path) -> None:
    import subprocess
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "proj"\nversion = "0.1"\n'
                                            'requires-python = ">=3.10"\n'
                                            'dependencies = ["alpha"]\n')
    subprocess.run([sys.executable, "-m", "uv", "lock", "--no-index", "--find-links",
                    str(links), "-q"], cwd=project, check=True, timeout=120)
    store = WheelStore(tmp_path / "store")
    by_pyproject = resolve(project / "pyproject.toml", HERE, find_links=[links], refresh=False,
                           store=store, trusted=False)
    by_lock = resolve(project / "uv.lock", HERE, find_links=[], refresh=False, store=store,
                      trusted=False)
    assert by_lock.kind == "uv.lock" and by_pyproject.kind == "pyproject"
    assert by_lock.digest == by_pyproject.digest
    assert [w.name for w in by_lock.wheels] == ["alpha", "beta"]


def _pylock(path: Path, wheels: list[tuple[str, str, Path, str]]) -> Path:
    lines = ['lock-version = "1.0"', 'created-by = "test"']
    for name, version, wheel, sha in wheels:
        lines += ["[[packages]]", f'name = "{name}"', f'version = "{version}"',
                  f'wheels = [{{ name = "{wheel.name}", hashes = {{ sha256 = "{sha}" }} }}]']
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_lock_downloaded_by_pip_is_checked_and_stored(tmp_path: Path, links: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))  # pip's own configuration: its "index"
    beta = links / "beta-2.1-py3-none-any.whl"
    torch = make_wheel(tmp_path / "t", "torch", "2.13.0")
    lock = _pylock(tmp_path / "pylock.toml", [("beta", "2.1", beta, sha256_of(beta)),
                                               ("torch", "2.13.0", torch, sha256_of(torch))])
    store = WheelStore(tmp_path / "store")
    env = resolve(lock, HERE, find_links=[], refresh=False, store=store, trusted=False)
    assert [(w.name, w.version) for w in env.wheels] == [("beta", "2.1")]
    assert env.held == (("torch", "2.13.0"),)  # pinned, held back for check_torch
    assert store.path(env.wheels[0]).read_bytes() == beta.read_bytes()


def test_a_hash_mismatch_names_package_expected_and_actual(tmp_path: Path, links: Path) -> None:
    beta = links / "beta-2.1-py3-none-any.whl"
    lock = _pylock(tmp_path / "pylock.toml", [("beta", "2.1", beta, "0" * 64)])
    with pytest.raises(UsageError) as exc:
        resolve(lock, HERE, find_links=[links], refresh=False, store=WheelStore(tmp_path / "s"),
                trusted=False)
    said = str(exc.value)
    assert "beta 2.1" in said and "0" * 64 in said and sha256_of(beta) in said
    assert exc.value.exit_code == 2
    assert not list((tmp_path / "s").rglob("*.json"))  # nothing stored for it


def test_no_wheel_for_the_platform_names_package_and_platform(tmp_path: Path,
                                                              links: Path) -> None:
    make_wheel(links, "nativeonly", "1.0", tag="cp39-cp39-manylinux_2_17_aarch64")
    req = tmp_path / "requirements.txt"
    req.write_text(f"nativeonly==1.0 --hash=sha256:{'1' * 64}\n")
    with pytest.raises(UsageError) as exc:
        resolve(req, HERE, find_links=[links], refresh=False, store=WheelStore(tmp_path / "s"),
                trusted=False)
    said = exc.value.problem
    assert said.code == "venvs.build-untrusted" and "--trust-cluster-file" in str(said.fix)
    assert (said.fields["name"], said.fields["version"]) == ("nativeonly", "1.0")
    assert said.fields["platform"] == str(HERE)


def test_a_package_that_does_not_exist_is_named(tmp_path: Path, links: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("alpha\nno-such-package-here\n")
    with pytest.raises(UsageError) as exc:
        resolve(req, HERE, find_links=[links], refresh=False, store=WheelStore(tmp_path / "s"),
                trusted=False)
    assert "no-such-package-here" in str(exc.value) and exc.value.exit_code == 2


def test_each_distinct_platform_is_resolved_once(tmp_path: Path, links: Path) -> None:
    from ptcluster.venvs.choice import EnvChoice
    from ptcluster.venvs.resolve import resolve_each
    req = tmp_path / "requirements.txt"
    req.write_text("alpha\n")
    older = Platform(HERE.python, HERE.machine, "2.28")
    choice = EnvChoice(requirements=req, find_links=(links,), refresh=False, trusted=False)
    envs = resolve_each(choice, [HERE, older, HERE], WheelStore(tmp_path / "store"))
    assert list(envs) == [HERE, older]
    assert envs[HERE].wheels == envs[older].wheels  # pure-Python wheels: the same files
    assert envs[HERE].digest != envs[older].digest  # but each platform its own environment


def test_a_trusted_sdist_only_package_needs_a_compiler_and_the_nodes_platform(
        tmp_path: Path, links: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_wheel(links, "nativeonly", "1.0", tag="cp39-cp39-manylinux_2_17_aarch64")
    req = tmp_path / "requirements.txt"
    req.write_text(f"nativeonly==1.0 --hash=sha256:{'1' * 64}\n")
    other = Platform(HERE.python, "aarch64" if HERE.machine != "aarch64" else "x86_64", "2.36")
    with pytest.raises(UsageError) as exc:
        resolve(req, other, find_links=[links], refresh=False, store=WheelStore(tmp_path / "s"),
                trusted=True)
    assert exc.value.code == "venvs.build-elsewhere"
    assert exc.value.problem.fields["machine"] == HERE.machine
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no cc, no gcc
    with pytest.raises(UsageError) as exc:
        resolve(req, HERE, find_links=[links], refresh=False, store=WheelStore(tmp_path / "s"),
                trusted=True)
    assert exc.value.code == "venvs.build-no-compiler"
