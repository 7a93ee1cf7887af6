"""Run a Python program on one rank so that any failure aborts the whole job.

``commwire run`` starts ``python script.py`` as ``python -m commwire._rankmain
script.py``. An unhandled exception, or ``sys.exit`` with a non-zero status,
prints this rank's number and traceback and calls MPI_Abort, so the other
ranks never wait forever in a collective the failed rank will not join.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from .comm.ranklog import record, start_guardian
from .comm.runtime import _report_and_abort, install_abort_hook


def _run(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m commwire._rankmain (script | -m module | -c code) [args...]")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("-m needs a module name")
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        if len(argv) < 2:
            raise SystemExit("-c needs a code string")
        sys.argv = ["-c"] + argv[2:]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - this is `python -c`
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` does
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    """Run the program named on the command line under the abort hook."""
    record("running")
    start_guardian()  # before MPI and threads: forking is safe now
    install_abort_hook()
    try:
        _run(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
        if code not in (None, 0):
            if not isinstance(code, int):
                sys.stderr.write(f"{code}\n")
            _report_and_abort(f"SystemExit({code!r})\n")
        record("exited")
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure must abort the job
        _report_and_abort("".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__))))
    record("exited")


def _user_frames(tb):  # type: ignore[no-untyped-def]
    # Drop this wrapper's and runpy's frames so the traceback starts in user code.
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__,)
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    main()
