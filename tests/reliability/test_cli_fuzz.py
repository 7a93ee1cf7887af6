"""Fuzz the command line through ``commwire.cli.main(args)`` — tier 1 (single process, nothing launched).

Random and invalid argument lists for the top level, ``info``, ``bench NAME ...``,
``run --dry-run ...`` and ``lab``. Only parse paths run: every ``bench`` list
ends in ``--help`` or an unknown option (so no benchmark starts and no ``-np``
above 1 reaches a launcher), ``run`` always has ``--dry-run`` first, and ``lab``
gets only parse errors or ``--help``.

The invariant: ``main`` returns 0, 1 or 2; a non-zero status ends the output
with a one-line error, ``WHERE: message`` (``commwire run: ...``, click's
``Error: ...``, argparse's ``prog: error: ...``)
or is a group's full help page (click's answer to a missing command, status 2);
never a Python traceback, never an exception out of ``main``.

Arguments never hold NUL (no shell can pass one) or a newline (an echoed
newline would split the one-line error). Profiles as in conftest.py: "ci" by default, "soak" for 10,000 cases.
"""

from __future__ import annotations

import contextlib
import io
import re
import traceback

from hypothesis import given
from hypothesis import strategies as st

import _oracle as oracle
from commwire.cli import main
from commwire.bench import registry

BENCHMARKS = registry()
DRIVERS = sorted(name for name, module in BENCHMARKS.items() if module.DRIVER)

JUNK = st.one_of(
    st.sampled_from(["", "-", "--", "--zz", "=", "foo", "1", "-1", "0", "9" * 25, "é", " ", "a b", "'", '"',
                     "--help=1", "--version", "-x", "--json", "1.5", "nan", "--", "\\", "$HOME", "~"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\n"), max_size=8),
)
# never above 1: "bench NAME -np 2" (not a driver) would launch the benchmark through mpiexec
NP_VALUES = st.one_of(st.integers(-3, 1).map(str), st.sampled_from(["abc", "1.5", "", "2e0", "0x1", "-" + "9" * 24]))
BENCH_OPTIONS = ["--sizes", "--repeats", "--budget", "--codec", "--codecs", "--json", "--np", "--out", "--quick",
                 "--only", "--threads", "--scenarios", "--timeout", "--datasets", "--lr", "--steps", "--help"]


def _safe_for_bench(token: str) -> bool:
    # click takes "-n"/"-np" (also "-n5", "-hn5") anywhere after NAME: a value above 1 would launch mpiexec.
    return not (token.startswith("-") and not token.startswith("--") and "n" in token)


bench_args = st.builds(
    lambda name, np_, sep, middle, end: ["bench", name, *np_, *sep, *middle, end],
    name=st.one_of(st.sampled_from(sorted(BENCHMARKS)), JUNK),
    np_=st.one_of(st.just([]), NP_VALUES.map(lambda v: ["-np", v])),
    sep=st.sampled_from([[], ["--"]]),  # after "--" the benchmark's own parser sees --help / the bad option
    middle=st.lists(st.one_of(st.sampled_from(BENCH_OPTIONS), JUNK).filter(_safe_for_bench), max_size=4),
    end=st.one_of(st.sampled_from(["--help", "-h", "--zzbogus"]), st.text("abc", min_size=1, max_size=4).map(
        lambda s: "--zz" + s)),
)
driver_args = st.builds(lambda name, np_, end: ["bench", name, "-np", np_, end],
                        name=st.sampled_from(sorted(DRIVERS)), np_=st.integers(-2, 64).map(str),
                        end=st.sampled_from(["--help", "--zzq"]))
hosts = st.one_of(st.sampled_from(["a:2,b:2", "a:0", "a:b", ":", ",", "a:2,,b", "a:-1", "a:00", "a:²", " "]),
                  st.text(alphabet="ab:,0123 ", max_size=8))
run_option = st.one_of(
    st.tuples(st.sampled_from(["-np", "-n"]), st.one_of(NP_VALUES, st.integers(-5, 10**6).map(str))),
    st.tuples(st.sampled_from(["-H", "--hosts"]), hosts),
    st.tuples(st.just("--hostfile"), st.sampled_from(["/nonexistent/hosts", "/", "/etc/hostname", ""])),
    st.tuples(st.just("-x"), st.one_of(st.sampled_from(["A", "A=1", "=1", "1=2", "A B=1", "A=", ""]), JUNK)),
    st.tuples(st.just("--mpi-args"), st.one_of(st.sampled_from(['"x', "'", "-bind-to core", "", "a\\"]), JUNK)),
    st.tuples(st.just("--timeline"), st.sampled_from(["/tmp/commwire-fuzz-timeline.json", ""])),
    st.tuples(st.just("--launcher"), st.one_of(st.sampled_from(["mpich", "openmpi", "intel", "slurm"]), JUNK)),
    st.sampled_from([("--check",), ("--lab",), ("--no-wrap",), ("-h",), ("--zz",), ("-np",), ("--launcher",)]),
)
run_args = st.builds(
    lambda options, command: ["run", "--dry-run", *[t for o in options for t in o], *command],
    options=st.lists(run_option, max_size=5),
    command=st.lists(st.one_of(st.sampled_from(["python", "python3", "-m", "x.py", "-c", "--"]), JUNK), max_size=3),
)
lab_args = st.one_of(
    st.sampled_from([["lab"], ["lab", "--help"], ["lab", "cut"], ["lab", "heal"], ["lab", "nosuch"],
                     ["lab", "up", "--bandwidth"], ["lab", "status", "--zz"], ["lab", "down", "extra"],
                     ["lab", "cut", "--help"], ["lab", "up", "--help"]]),
    st.builds(lambda v: ["lab", "up", "--hosts", v], st.sampled_from(["x", "1.5", "", "--zz"])),
)
top_args = st.one_of(
    st.sampled_from([[], ["-h"], ["--help"], ["--version"], ["info", "--help"], ["info"]]),
    st.builds(lambda extra: ["info", *extra], st.lists(JUNK, min_size=1, max_size=2)),
    # never a command name first: "run" without --dry-run would launch, "lab up" would build namespaces
    st.lists(JUNK, min_size=1, max_size=4).filter(lambda a: a[0] not in ("run", "bench", "lab", "info")),
)
cli_args = st.one_of(top_args, bench_args, driver_args, run_args, lab_args)


_ERROR_LINE = re.compile(r"[\w][\w .\-]*: \S")
"""A one-line error: ``commwire run: ...``, click's ``Error: ...``, argparse's ``prog: error: ...``."""


def cli_case(args: list[str]) -> str:
    """Run ``main(args)``; return "" when the invariant holds, else what broke it."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(args)
    except BaseException as exc:  # noqa: BLE001 - anything out of main() is a traceback for the user
        return f"{args!r}: {type(exc).__name__} escaped main(): {exc}\n{traceback.format_exc(limit=-4)}"
    text = out.getvalue() + err.getvalue()
    if "Traceback (most recent call last)" in text:
        return f"{args!r}: printed a traceback:\n{text[-2000:]}"
    if status not in (0, 1, 2):
        return f"{args!r}: exit status {status!r}, expected 0, 1 or 2"
    if status:
        shown = err.getvalue() or out.getvalue()
        lines = [line for line in shown.split("\n") if line.strip()]  # "\r" etc. may be echoed input
        if shown.startswith("Usage:") and "\nOptions:" in shown:
            return ""  # a group called without its command shows its help (click: status 2)
        if not lines or not _ERROR_LINE.match(lines[-1]):
            return f"{args!r}: exit status {status} without a one-line error at the end:\n{text[-1000:]}"
    return ""


@given(args=cli_args)
def test_cli_fuzz(args):
    problem = cli_case(args)
    assert not oracle.count("cli", problem), problem


def test_cli_case_detects_a_traceback(monkeypatch):
    # The invariant's own check: an exception out of a command is reported, not swallowed.
    import commwire.info

    def broken_collect():
        raise KeyError("boom")

    monkeypatch.setattr(commwire.info, "collect", broken_collect)
    assert "KeyError escaped main()" in cli_case(["info"])
