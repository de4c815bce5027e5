"""Issue 42: a node lost in the middle of its environment's build, with the real node program
over real channels (local "nodes", each its own ptcluster directory).

The build of n2 is held by a uv stand-in that sleeps (its pid in the build folder); n1's
build runs the real uv. n2's node program is then killed (SIGKILL: the node is gone, nothing of
it may clean up): the ship names n2 and keeps n1's environment; nothing n2 started outlives it;
its half-built folder is never taken as its environment, and the next ship builds it there
from the wheels n2 had already received (none sent again).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from ptcluster.venvs.resolved import ResolvedEnv
from ptcluster.venvs.ship import BUILT, FAILED, UP_TO_DATE, ship
from tests.local.test_venvs import Wheels, local_nodes
from tests.support.wheels import resolved, slow_tool_wheel, uv_wheel

UV = uv_wheel()
REPO = Path(__file__).resolve().parents[2]
HELD_UV = """#!/bin/sh
# a stand-in for uv: a build held by a file `hold` in its node's ptcluster directory stops
# in its first step (its pid in the build folder); any other runs the real uv
for last; do :; done
case "$last" in
*/envs/.build-*) if [ -e "${last%/envs/*}/hold" ]; then
    mkdir -p "$last/bin"; echo $$ > "$last/pid"; exec sleep 300; fi;;
esac
exec REAL_UV "$@"
"""


def held_env(tmp: Path) -> tuple[Wheels, ResolvedEnv]:
    """The wheels of a test environment (one package) whose uv is the stand-in above."""
    assert UV is not None
    (tmp / "wheels").mkdir()
    wheels = Wheels(tmp / "wheels")
    real = tmp / "real-uv"
    with zipfile.ZipFile(UV) as z:
        name = next(n for n in z.namelist() if n.endswith(".data/scripts/uv"))
        real.write_bytes(z.read(name))
    real.chmod(0o755)
    tool = slow_tool_wheel(wheels.folder, HELD_UV.replace("REAL_UV", str(real)))
    wheels.paths[tool.sha256] = wheels.folder / tool.filename
    a = wheels.make("tinya", "1.0")
    return wheels, ResolvedEnv("requirements.txt", "requirements",
                               resolved({}, None).platform, (a,), (tool,))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(") ")[1].split()[1])


@pytest.mark.skipif(UV is None, reason="no uv wheel at hand (PTC_UV_WHEEL)")
def test_a_node_lost_mid_build_is_named_leaves_no_process_and_no_environment(
        tmp_path: Path) -> None:
    wheels, env = held_env(tmp_path)
    members = local_nodes(tmp_path, "n1", "n2")
    (tmp_path / "root-n2").mkdir()
    (tmp_path / "root-n2" / "hold").touch()
    envs = tmp_path / "root-n2" / "envs"
    got: list = []
    shipping = threading.Thread(target=lambda: got.append(
        ship(members, lambda p: env, wheels.locate)), daemon=True)
    shipping.start()
    deadline = time.monotonic() + 60
    while not list(envs.glob(".build-*/pid")) and time.monotonic() < deadline:
        time.sleep(0.05)
    (pid_file,) = envs.glob(".build-*/pid")
    held = int(pid_file.read_text())
    agent = _ppid(held)  # n2's node program: the held step is its child
    try:
        os.kill(agent, signal.SIGKILL)  # the node is gone: nothing of it cleans up
        shipping.join(60)
        deadline = time.monotonic() + 10
        while _alive(held) and time.monotonic() < deadline:
            time.sleep(0.05)
        outlived = _alive(held)
    finally:
        if _alive(held):  # (this test's own leftover, whatever happened above)
            os.kill(held, signal.SIGKILL)
    assert not outlived, "the build step of the lost node outlived it"
    assert got, "the ship did not end"
    result = got[0]
    assert result.nodes["n1"].state == BUILT, result.nodes["n1"]
    lost = result.nodes["n2"]
    assert lost.state == FAILED and lost.problem is not None and lost.problem.who == "n2", lost
    assert (tmp_path / "root-n1" / "envs" / env.digest / "bin" / "python").exists()
    assert not (envs / env.digest).exists()
    # the next ship: n2 builds anew (the half-built folder is not its environment) from the
    # wheels it had received before it was lost (none sent again); n1 has it already
    (tmp_path / "root-n2" / "hold").unlink()
    again = ship(members, lambda p: env, wheels.locate)
    assert again.nodes["n1"].state == UP_TO_DATE, again.nodes["n1"]
    assert again.nodes["n2"].state == BUILT and again.nodes["n2"].wheels_sent == 0, \
        again.nodes["n2"]
    assert (envs / env.digest / "bin" / "python").exists()
    assert not list(envs.glob(".build-*")), "the lost build's folder is still there"


def silent_head(tmp: str) -> None:
    """The head of the next test, in a process of its own: ships to n2 (held in its build),
    with 3 s of silence before n2's program gives up on the head."""
    wheels, env = held_env(Path(tmp))
    (member,) = local_nodes(Path(tmp), "n2")
    member.config["silence"] = 3.0
    ship([member], lambda p: env, wheels.locate)


@pytest.mark.skipif(UV is None, reason="no uv wheel at hand (PTC_UV_WHEEL)")
def test_a_build_whose_head_goes_silent_ends_without_eof(tmp_path: Path) -> None:
    """A link cut mid-build: the node sees silence, never EOF (its sshd keeps the session). The
    head is stopped (SIGSTOP: its pipes stay open) while n2's build holds: n2's program stops
    the build, removes its folder and ends by itself, its build step with it."""
    (tmp_path / "root-n2").mkdir()
    (tmp_path / "root-n2" / "hold").touch()
    head = subprocess.Popen([sys.executable, "-c", "import sys; from tests.local.test_venvs_lost "
                             "import silent_head; silent_head(sys.argv[1])", str(tmp_path)],
                            cwd=REPO, start_new_session=True)
    envs = tmp_path / "root-n2" / "envs"
    held = agent = 0
    try:
        deadline = time.monotonic() + 60
        while not list(envs.glob(".build-*/pid")) and time.monotonic() < deadline:
            assert head.poll() is None, "the head ended before the build held"
            time.sleep(0.05)
        (pid_file,) = envs.glob(".build-*/pid")
        held = int(pid_file.read_text())
        agent = _ppid(held)
        os.kill(head.pid, signal.SIGSTOP)  # silent, its pipes open: as a cut link
        deadline = time.monotonic() + 20
        while (_alive(agent) or _alive(held)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in (agent, held) if _alive(pid)]
        builds = list(envs.glob(".build-*"))
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(10)
        for pid in (agent, held):
            if pid and _alive(pid):  # (this test's own leftovers, whatever happened above)
                os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after 20 s of the head's silence: {left}"
    assert not builds, builds
