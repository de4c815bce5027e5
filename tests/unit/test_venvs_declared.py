"""The project's environment, head side, without processes: the four declared kinds read into
pins (and bad input refused), the digest, the torch and trust refusals, the platform's tags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ptcluster.cluster.trust import TRUST_FLAG
from ptcluster.errors import UsageError
from ptcluster.venvs.declared import kind_of, read_declared
from ptcluster.venvs.platforms import best_file, linux_platforms, uv_platform
from ptcluster.venvs.resolve import check_torch, check_trust
from ptcluster.venvs.resolved import Platform, ResolvedEnv, Wheel, setup_owns

LINUX = Platform("3.11", "x86_64", "2.36")
H1, H2, H3 = "a" * 64, "b" * 64, "c" * 64

UV_LOCK = f'''
version = 1
requires-python = ">=3.10"

[[package]]
name = "proj"
version = "0.1.0"
source = {{ virtual = "." }}
dependencies = [{{ name = "alpha" }}, {{ name = "gamma", extra = ["fast"] }}]

[package.dev-dependencies]
dev = [{{ name = "devtool" }}]

[[package]]
name = "Alpha"
version = "1.0"
source = {{ registry = "https://pypi.org/simple" }}
dependencies = [{{ name = "beta" }}, {{ name = "winonly", marker = "sys_platform == 'win32'" }}]
wheels = [
    {{ url = "https://files/alpha-1.0-py3-none-any.whl", hash = "sha256:{H1}", size = 1 }},
]

[[package]]
name = "beta"
version = "2.1"
source = {{ registry = "https://pypi.org/simple" }}
sdist = {{ url = "https://files/beta-2.1.tar.gz", hash = "sha256:{H3}" }}
wheels = [
    {{ url = "https://f/beta-2.1-cp311-cp311-manylinux_2_17_x86_64.whl", hash = "sha256:{H2}" }},
]

[[package]]
name = "gamma"
version = "3.0"
source = {{ registry = "https://pypi.org/simple" }}
wheels = [{{ url = "https://files/gamma-3.0-py3-none-any.whl", hash = "sha256:{H3}" }}]
[package.optional-dependencies]
fast = [{{ name = "torch" }}]

[[package]]
name = "torch"
version = "2.13.0"
source = {{ registry = "https://pypi.org/simple" }}
wheels = [
    {{ url = "https://f/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", hash="sha256:{H1}" }},
]

[[package]]
name = "winonly"
version = "1.0"
source = {{ registry = "https://pypi.org/simple" }}
wheels = [{{ url = "https://files/winonly-1.0-py3-none-any.whl", hash = "sha256:{H2}" }}]

[[package]]
name = "devtool"
version = "1.0"
source = {{ registry = "https://pypi.org/simple" }}
wheels = [{{ url = "https://files/devtool-1.0-py3-none-any.whl", hash = "sha256:{H2}" }}]
'''

PYLOCK = f'''
lock-version = "1.0"
created-by = "uv"

[[packages]]
name = "alpha"
version = "1.0"
index = "https://pypi.org/simple"
wheels = [{{ url = "https://files/alpha-1.0-py3-none-any.whl", hashes = {{ sha256 = "{H1}" }} }}]

[[packages]]
name = "winonly"
version = "1.0"
marker = "sys_platform == 'win32'"
wheels = [{{ name = "winonly-1.0-py3-none-any.whl", hashes = {{ sha256 = "{H2}" }} }}]

[[packages]]
name = "private"
version = "0.2"
index = "https://example.org/simple"
wheels = [{{ name = "private-0.2-py3-none-any.whl", hashes = {{ sha256 = "{H3}" }} }}]
'''


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def pins(path: Path) -> list[tuple[str, str]]:
    declared = read_declared(path, LINUX)
    assert declared.pins is not None
    return [(p.name, p.version) for p in declared.pins]


def test_uv_lock_follows_the_projects_edges_for_the_node(tmp_path: Path) -> None:
    path = write(tmp_path, "uv.lock", UV_LOCK)
    # the project itself, the Windows-only edge and the dev group are left out; the extra's
    # edge is followed; torch stays (resolve holds it back, setup owns it)
    assert pins(path) == [("alpha", "1.0"), ("beta", "2.1"), ("gamma", "3.0"),
                          ("torch", "2.13.0")]
    beta = next(p for p in read_declared(path, LINUX).pins or () if p.name == "beta")
    assert beta.hashes == {H2}  # the wheels' digests, not the sdist's
    assert read_declared(path, LINUX).elsewhere == ()


def test_uv_lock_on_windows_markers_would_take_the_windows_package(tmp_path: Path) -> None:
    # (the marker decides: a lock is universal) - an aarch64 node still gets no winonly
    path = write(tmp_path, "uv.lock", UV_LOCK)
    arm = read_declared(path, Platform("3.11", "aarch64", "2.36"))
    assert "winonly" not in [p.name for p in arm.pins or ()]


def test_pylock_takes_the_packages_whose_marker_holds_and_notes_another_index(
        tmp_path: Path) -> None:
    path = write(tmp_path, "pylock.toml", PYLOCK)
    assert pins(path) == [("alpha", "1.0"), ("private", "0.2")]
    declared = read_declared(path, LINUX)
    assert declared.kind == "pylock.toml"
    assert declared.elsewhere == ("the index https://example.org/simple (package private)",)


def test_requirements_pinned_with_hashes_is_exact_and_follows_includes(tmp_path: Path) -> None:
    write(tmp_path, "base.txt", f"Beta==2.1 --hash=sha256:{H2}\n")
    path = write(tmp_path, "requirements.txt",
                 f"# the project's\n-r base.txt\nalpha==1.0 \\\n    --hash=sha256:{H1} \\\n"
                 f"    --hash=sha256:{H3}  # two files\n")
    declared = read_declared(path, LINUX)
    assert declared.pins is not None
    assert sorted((p.name, p.version, p.hashes) for p in declared.pins) == [
        ("alpha", "1.0", frozenset({H1, H3})), ("beta", "2.1", frozenset({H2}))]


def test_requirements_content_key_covers_the_included_file(tmp_path: Path) -> None:
    base = write(tmp_path, "base.txt", "beta\n")
    path = write(tmp_path, "requirements.txt", "-r base.txt\nalpha>=1\n")
    before = read_declared(path, LINUX).content
    base.write_text("beta>=2\n")
    assert read_declared(path, LINUX).content != before


@pytest.mark.parametrize("text", ["alpha>=1.0\n", "alpha==1.0\n", "alpha==1.*  --hash=sha256:"
                                  + H1 + "\n", f"alpha==1 --hash=sha256:{H1}\nbeta\n"])
def test_requirements_not_all_pinned_with_hashes_is_resolved(tmp_path: Path, text: str) -> None:
    declared = read_declared(write(tmp_path, "requirements.txt", text), LINUX)
    assert declared.pins is None and declared.kind == "requirements"


def test_requirements_index_lines_are_noted_for_trust(tmp_path: Path) -> None:
    path = write(tmp_path, "requirements.txt",
                 "--index-url https://mirror.example/simple\n--extra-index-url=https://x/s\n"
                 "-f ./wheels\nalpha\n")
    elsewhere = read_declared(path, LINUX).elsewhere
    assert [e.split(" (")[0] for e in elsewhere] == [
        "--index-url https://mirror.example/simple", "--extra-index-url https://x/s",
        "-f ./wheels"]
    assert read_declared(path, LINUX).indexes == ("https://mirror.example/simple", "https://x/s")
    with pytest.raises(UsageError) as exc:
        check_trust(read_declared(path, LINUX), trusted=False)
    problem = exc.value.problem
    assert (problem.code, problem.fields) == ("venvs.index-untrusted", {
        "source": str(path), "elsewhere": elsewhere[0]}) and exc.value.exit_code == 2
    assert TRUST_FLAG in str(problem.fix)
    check_trust(read_declared(path, LINUX), trusted=True)  # vouched for: allowed


def test_pyproject_dependencies_are_resolved(tmp_path: Path) -> None:
    path = write(tmp_path, "pyproject.toml",
                 '[project]\nname = "p"\nversion = "1"\ndependencies = ["alpha>=1", '
                 '"beta; python_version >= \'3.10\'"]\n')
    declared = read_declared(path, LINUX)
    assert declared.pins is None and declared.kind == "pyproject"
    assert declared.requirements == ("alpha>=1", "beta; python_version >= '3.10'")


@pytest.mark.parametrize(("name", "text", "said"), [
    ("environment.yml", "x", "not a file ptcluster reads an environment from"),
    ("requirements.txt", "-e .\n", "editable requirement"),
    ("requirements.txt", "--no-clean\nalpha\n", "option --no-clean is not one ptcluster reads"),
    ("requirements.txt", "alpha @ https://x/a.whl\n", "comes from a URL"),
    ("requirements.txt", "alpha >>= 1\n", "is not a requirement"),
    ("requirements.txt", "-r missing.txt\n", "the included file is not there"),
    ("pyproject.toml", "[tool.x]\n", "has no [project] table"),
    ("pyproject.toml", "[project\n", "not valid TOML"),
    ("pyproject.toml", '[project]\ndynamic = ["dependencies"]\n', "dynamic"),
    ("uv.lock", "version = 1\n", "names no project"),
    ("uv.lock", UV_LOCK.replace('"sha256:' + H1, '"md5:' + H1, 1), "is not sha256:HEX"),
    ("uv.lock", UV_LOCK.replace('{ registry = "https://pypi.org/simple" }',
                                '{ git = "https://github.com/x/alpha" }', 1), "comes from git"),
    ("pylock.toml", 'lock-version = "2.0"\n', "is not 1.x"),
    ("pylock.toml", 'lock-version = "1.0"\n[[packages]]\nname = "a"\nversion = "1"\n'
                    'wheels = [{ name = "a-1-py3-none-any.whl" }]\n', "without a sha256"),
])
def test_bad_input_is_one_exit_2_error_naming_the_file(tmp_path: Path, name: str, text: str,
                                                        said: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(UsageError) as exc:
        read_declared(path, LINUX)
    assert exc.value.exit_code == 2
    assert said in str(exc.value) and str(path) in str(exc.value)
    assert exc.value.fix


def test_kind_of_names_the_four_kinds() -> None:
    assert kind_of(Path("a/uv.lock")) == "uv.lock"
    assert kind_of(Path("pylock.gpu.toml")) == "pylock.toml"
    assert kind_of(Path("requirements-train.txt")) == "requirements"
    assert kind_of(Path("x/pyproject.toml")) == "pyproject"
    with pytest.raises(UsageError) as exc:
        kind_of(Path("Pipfile.lock"))
    assert exc.value.code == "venvs.not-a-requirements-file"
    assert exc.value.problem.fields == {"path": "Pipfile.lock"}


def _env(wheels: list[Wheel], platform: Platform = LINUX) -> ResolvedEnv:
    uv = Wheel("uv", "0.13.9", "uv-0.13.9-py3-none-manylinux_2_17_x86_64.whl", H3, 9)
    return ResolvedEnv(source="r.txt", kind="requirements", platform=platform,
                       wheels=tuple(sorted(wheels, key=lambda w: w.name)), tools=(uv,))


A = Wheel("alpha", "1.0", "alpha-1.0-py3-none-any.whl", H1, 10)
B = Wheel("beta", "2.1", "beta-2.1-py3-none-any.whl", H2, 20)


def test_digest_is_stable_and_order_independent() -> None:
    digest = _env([A, B]).digest
    assert digest == _env([B, A]).digest
    assert len(digest) == 64 and digest == _env([A, B]).digest
    # not the source, the kind or the tool: only what the environment holds
    other_tool = dataclasses.replace(_env([A, B]), source="elsewhere.txt", tools=())
    assert other_tool.digest == digest
    assert _env([A, B]).python_path == f"~/.ptcluster/envs/{digest}/bin/python"


@pytest.mark.parametrize("change", [
    lambda: _env([A, dataclasses.replace(B, sha256=H3)]),
    lambda: _env([A, dataclasses.replace(B, version="2.2")]),
    lambda: _env([A]),
    lambda: _env([A, B], Platform("3.12", "x86_64", "2.36")),
    lambda: _env([A, B], Platform("3.11", "aarch64", "2.36")),
    lambda: _env([A, B], Platform("3.11", "x86_64", "2.35")),
])
def test_digest_changes_with_any_hash_version_or_platform(change: object) -> None:
    assert callable(change)
    assert change().digest != _env([A, B]).digest


def test_json_round_trip_and_a_tampered_record_is_refused() -> None:
    env = dataclasses.replace(_env([A, B]), held=(("torch", "2.13.0"),))
    data = env.to_json()
    assert ResolvedEnv.from_json(data) == env
    data["wheels"][0]["sha256"] = H3  # type: ignore[index]
    with pytest.raises(ValueError, match="does not match"):
        ResolvedEnv.from_json(data)


def test_setup_owns_torch_its_cuda_libraries_triton_and_ptcluster() -> None:
    assert all(setup_owns(n) for n in ("torch", "Torch", "nvidia-cublas-cu12", "triton",
                                       "ptcluster", "nvidia_nccl_cu12"))
    assert not setup_owns("torchvision") and not setup_owns("numpy")


@pytest.mark.parametrize(("pinned", "node", "ok"), [
    ("2.13.0", "2.13.0+cpu", True), ("2.13.0", "2.13.0+cu128", True),
    ("2.13.0+cpu", "2.13.0+cpu", True), ("2.13.0+cu128", "2.13.0+cpu", False),
    ("2.12.1", "2.13.0+cpu", False),
])
def test_check_torch_refuses_another_version_naming_both(pinned: str, node: str,
                                                         ok: bool) -> None:
    if ok:
        check_torch([("numpy", "2.1"), ("torch", pinned)], node)
        return
    with pytest.raises(UsageError) as exc:
        check_torch([("torch", pinned)], node)
    assert exc.value.code == "venvs.torch-differs" and exc.value.exit_code == 2
    assert exc.value.problem.fields == {"version": pinned, "node_torch": node,
                                        "node_release": node.split("+")[0]}


def test_platform_tags_pick_the_best_fitting_wheel() -> None:
    files = ["x-1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
             "x-1-cp311-cp311-manylinux_2_28_x86_64.whl", "x-1-py3-none-any.whl",
             "x-1-cp311-cp311-manylinux_2_39_x86_64.whl",
             "x-1-cp312-cp312-manylinux_2_28_x86_64.whl",
             "x-1-cp311-cp311-win_amd64.whl"]
    assert best_file(files, LINUX) == "x-1-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert best_file(files, Platform("3.11", "x86_64", "2.17")) == files[0]
    assert best_file(files, Platform("3.10", "x86_64", "2.36")) == "x-1-py3-none-any.whl"
    assert best_file(files[-2:], LINUX) is None
    assert linux_platforms(LINUX)[0] == "manylinux_2_36_x86_64"
    assert uv_platform(LINUX) == "x86_64-manylinux_2_36"
    assert uv_platform(Platform("3.11", "aarch64", "2.30")) == "aarch64-manylinux_2_28"
    assert uv_platform(Platform("3.11", "x86_64", "2.41")) == "x86_64-manylinux_2_40"
    with pytest.raises(UsageError):
        uv_platform(Platform("3.11", "riscv64", "2.36"))


def test_check_torch_checks_a_ptcluster_pin_when_told_the_nodes_version() -> None:
    check_torch([("ptcluster", "0.1.0")], "2.13.0", node_ptcluster="0.1.0+g1a2b3c4d")
    check_torch([("ptcluster", "0.2.0")], "2.13.0")  # (not told: not checked)
    with pytest.raises(UsageError) as exc:
        check_torch([("ptcluster", "0.2.0")], "2.13.0", node_ptcluster="0.1.0+g1a2b3c4d")
    assert exc.value.code == "venvs.ptcluster-differs"
    assert exc.value.problem.fields == {"version": "0.2.0", "node_ptcluster": "0.1.0+g1a2b3c4d",
                                        "node_release": "0.1.0"}


@pytest.mark.parametrize(("name", "text"), [
    ("uv.lock", 'version = 1\nrequires-python = ">=3.12"\n'),
    ("pylock.toml", 'lock-version = "1.0"\nrequires-python = "<3.11"\n'),
    ("pyproject.toml", '[project]\nname = "p"\nrequires-python = ">=3.13"\ndependencies = []\n'),
])
def test_a_file_for_another_python_names_both(tmp_path: Path, name: str, text: str) -> None:
    with pytest.raises(UsageError) as exc:
        read_declared(write(tmp_path, name, text), LINUX)
    assert exc.value.code == "venvs.python-excluded" and exc.value.exit_code == 2
    assert exc.value.problem.fields["python"] == "3.11"
    ok = text.replace(">=3.12", ">=3.10").replace("<3.11", "<3.12").replace(">=3.13", ">=3.11")
    if name != "uv.lock":  # (that uv.lock names no project: refused for that, not Python)
        read_declared(write(tmp_path, name, ok), LINUX)


def test_store_keeps_a_wheel_once_by_digest_and_links_it_by_its_name(tmp_path: Path) -> None:
    import hashlib

    from ptcluster.venvs.store import WheelStore
    src = tmp_path / "alpha-1.0-py3-none-any.whl"
    src.write_bytes(b"not really a zip, but bytes with a digest")
    store = WheelStore(tmp_path / "store")
    wheel = store.add(src)
    assert wheel.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()
    assert (wheel.name, wheel.version, wheel.size) == ("alpha", "1.0", src.stat().st_size)
    assert store.add(src) == wheel and store.has(wheel.sha256) and store.get(wheel.sha256) == wheel
    assert store.find("Alpha", "1.0") == [wheel] and store.find("alpha", "2.0") == []
    assert sorted(p.name for p in store.path(wheel).parent.iterdir()) == sorted(
        [wheel.sha256, f"{wheel.sha256}.json"])  # no temporary file left
    store.link_into([wheel], tmp_path / "install")
    assert (tmp_path / "install" / src.name).read_bytes() == src.read_bytes()
    with pytest.raises(UsageError, match="not a wheel's file name"):
        bad = tmp_path / "alpha.zip"
        bad.write_bytes(b"x")
        store.add(bad)


def test_before_the_nodes_are_known_the_python_range_is_not_checked(tmp_path: Path) -> None:
    """The head's own Python is not the nodes': ``precheck`` (platform None) does not refuse a
    lock for another Python than the head's."""
    path = write(tmp_path, "pylock.toml", 'lock-version = "1.0"\nrequires-python = "<3.0"\n')
    assert read_declared(path, None).pins == ()


def test_requirements_marker_keeps_its_quotes_and_find_links_sees_setups_pins(
        tmp_path: Path) -> None:
    """A requirement line is read as pip reads it, not as a shell would (a marker's quotes
    stay); the exact pins of setup's packages the file states are found for check_torch."""
    from ptcluster.venvs.resolve import setup_pins
    hexd = "a" * 64
    path = tmp_path / "requirements.txt"
    path.write_text(f"six==1.16.0 ; python_version > '3' --hash=sha256:{hexd}\n")
    pins = read_declared(path, LINUX).pins
    assert pins is not None and pins[0].name == "six" and "python_version" in pins[0].marker
    path.write_text("six\ntorch==1.13.1 ; python_version > '3'\nPtcluster == 0.1\nnumpy==2\n")
    assert [(p.name, p.version) for p in setup_pins(read_declared(path, LINUX))] == \
        [("torch", "1.13.1"), ("ptcluster", "0.1")]
