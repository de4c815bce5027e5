"""The private-directory check (``safefile.unsafe_dir``), the one the heads registry, ssh's
socket directory and the guard's temp dirs use: what it refuses, and that its callers go by it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ptcluster.control import registry
from ptcluster.node.guard import tmpdirs
from ptcluster.node.sharing.safefile import open_dir, private_dir, unsafe_dir
from ptcluster.remote import transport


def test_a_directory_of_ours_closed_to_others_passes(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o700)
    assert unsafe_dir(os.lstat(tmp_path), others=0o077) == ""
    os.chmod(tmp_path, 0o755)
    assert unsafe_dir(os.lstat(tmp_path)) == ""  # others may look, not change


def test_another_owner_is_refused(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o700)
    other = os.getuid() + 1
    assert unsafe_dir(os.lstat(tmp_path), uid=other) == \
        f"belongs to uid {os.getuid()}, not to uid {other}"
    theirs = tmp_path / "theirs"  # a real directory of another user's
    theirs.mkdir(0o700)
    if os.getuid() == 0:
        os.chown(theirs, 1, -1)
    else:
        theirs = Path("/")
    owner = os.lstat(theirs).st_uid
    with pytest.raises(OSError, match=f"belongs to uid {owner}, not to uid {os.getuid()}"):
        private_dir(str(theirs))
    with pytest.raises(OSError, match=f"belongs to uid {owner}"):
        os.close(open_dir(str(theirs), others=0o022))


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o750, 0o705, 0o1777])
def test_group_or_others_access_is_refused_where_none_is_allowed(tmp_path: Path,
                                                                  mode: int) -> None:
    os.chmod(tmp_path, mode)
    assert unsafe_dir(os.lstat(tmp_path), others=0o077) == \
        f"is open to others (mode {mode:o}; it must be 700)"


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777])
def test_group_or_others_write_is_refused_where_they_may_look(tmp_path: Path,
                                                               mode: int) -> None:
    os.chmod(tmp_path, mode)
    assert unsafe_dir(os.lstat(tmp_path)) == f"is open to others (mode {mode:o})"
    with pytest.raises(OSError, match="is open to others"):
        open_dir(str(tmp_path), others=0o022)


def test_a_symlink_to_our_directory_is_not_a_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert unsafe_dir(os.lstat(link)) == "is not a directory"
    with pytest.raises(OSError, match="is not a directory"):
        private_dir(str(link))
    with pytest.raises(OSError):  # not followed: ELOOP
        os.close(open_dir(str(link)))


def test_a_file_is_not_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    assert unsafe_dir(os.lstat(path)) == "is not a directory"
    with pytest.raises(OSError, match="is not a directory"):
        private_dir(str(path))


def test_private_dir_makes_it_closed_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        made = private_dir(str(tmp_path / "new"))
    finally:
        os.umask(old)
    assert os.stat(made).st_mode & 0o777 == 0o700


def test_the_callers_go_by_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ssh's socket directory, the guard's runtime dir and the heads registry each refuse a
    directory open to others."""
    open_ = tmp_path / "open"
    open_.mkdir()
    os.chmod(open_, 0o777)
    (open_ / "ptcluster-ssh").mkdir(0o700)
    os.chmod(open_ / "ptcluster-ssh", 0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(open_))
    assert transport.control_dir() is None
    assert tmpdirs.runtime_dir() is None
    os.chmod(open_ / "ptcluster-ssh", 0o700)
    assert transport.control_dir() == str(open_ / "ptcluster-ssh")
    os.chmod(open_, 0o700)
    assert tmpdirs.runtime_dir() == str(open_)
    state = tmp_path / "state"
    (state / "ptcluster" / "heads").mkdir(parents=True)
    os.chmod(state / "ptcluster" / "heads", 0o750)
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    with pytest.raises(OSError, match="it must be 700"):
        registry.register("job-1", tmp_path)
    os.chmod(state / "ptcluster" / "heads", 0o700)
    registry.register("job-1", tmp_path)
    entry = registry.find("job-1")
    assert entry is not None and entry.run_dir == tmp_path
    registry.unregister("job-1")
