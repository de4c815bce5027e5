"""Runs inside every rank, around the user's script or module (standard library only).

torchrun starts ``python -u -c 'exec(os.environ[SHIM_VAR])' (-m MODULE | SCRIPT) ARGS``; this
code runs the target exactly as ``python -m``/``python SCRIPT`` would, and brackets it with two
control lines (start; exit code and duration) so the head can report every rank's outcome.
A rank killed by a signal writes no exit line: the head then reports it as killed.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback

MARK = "\x1ePTCW "


def _code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_target(argv: list[str]) -> int:
    rank = os.environ.get("RANK", "?")
    start = time.time()
    print(f"{MARK}start rank={rank} pid={os.getpid()}", flush=True)
    code = 0
    try:
        if argv and argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv and argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<ptcluster -c>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = _code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - report any failure of user code, then exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    end = time.time()
    print(f"{MARK}exit rank={rank} code={code} duration={end - start:.3f} end={end:.3f}",
          flush=True)
    return code


if __name__ == "__main__":
    sys.exit(run_target(sys.argv[1:]))
