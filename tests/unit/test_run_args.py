"""Which of ``ptcluster run``'s arguments are run's and which the program's (click's own parse)."""

from __future__ import annotations

import pytest

from ptcluster.cli.run_cmd import run


def parsed(*argv: str) -> dict:
    with run.make_context("run", list(argv)) as ctx:
        return ctx.params


@pytest.mark.parametrize("argv, module, port, nproc, args", [
    # after -m MODULE, as after a script, everything is the program's (was: --port taken by run)
    (["-m", "hello", "--port", "5"], "hello", None, None, ("--port", "5")),
    (["--cluster", "c.yaml", "-m", "hello", "--nproc", "2"], "hello", None, None,
     ("--nproc", "2")),
    (["-mhello", "--help"], "hello", None, None, ("--help",)),
    (["-m", "hello", "--", "--port", "5"], "hello", None, None, ("--port", "5")),
    (["--port", "6", "--nproc", "2", "-m", "hello", "-x"], "hello", 6, 2, ("-x",)),
    (["--nproc", "2", "train.py", "--port", "5", "-m", "x"], None, None, 2,
     ("train.py", "--port", "5", "-m", "x")),
])
def test_run_options_come_before_the_program(argv, module, port, nproc, args) -> None:
    params = parsed(*argv)
    assert (params["module"], params["port"], params["nproc"], params["args"]) == (
        module, port, nproc, args)
