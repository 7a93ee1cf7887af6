"""Check that errors agree across ranks, under plain ``mpiexec`` (no ``commwire run``).

Two measurements, each repeated ``--repeats`` times per case:

1. **Bad arguments, caught.** One job of ``--np`` ranks where, in each
   repetition, the last rank passes a bad argument (unsupported dtype, an
   average of integers, a root that is no rank, a mismatched shape) while the
   others pass good ones, and every rank catches the exception. For each
   case and repetition it records whether every rank raised (and the same
   type), the slowest rank's time from the call to the exception, and whether
   the next collective gave the right result. Each case runs both as a first
   call (a fresh name) and after an agreed call of the same name (the
   steady-state flag path).
2. **Uncaught exception.** ``--repeats`` jobs of ``--np`` ranks in which one
   rank raises outside any try block after ``commwire.init()`` while the
   others wait in a collective; it records how long each job takes to end.

Run: ``python -m commwire.bench.agreement --np 4 --repeats 20`` (it starts the
``mpiexec`` jobs itself, with the mpiexec next to this Python or on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

__all__ = ["NAME", "HELP", "DRIVER", "build_parser", "main", "CASES"]

NAME = "agreement"
HELP = "bad arguments and uncaught exceptions under plain mpiexec: every rank raises in time"
DRIVER = True

CASES = ("unsupported dtype", "avg of integers", "root out of range", "roots differ", "mismatched shape",
         "mismatched shape (large)")


def _case(name: str, comm: Any, label: str, bad: bool) -> Any:
    import numpy as np

    if name == "unsupported dtype":
        return comm.allreduce(np.ones(4, np.complex64 if bad else np.float32), name=label)
    if name == "avg of integers":
        return comm.allreduce(np.ones(4, np.int32 if bad else np.float32), "avg", name=label)
    if name == "root out of range":
        return comm.broadcast(np.ones(4), root=comm.size + 5 if bad else 0, name=label)
    if name == "roots differ":
        return comm.broadcast(np.ones(4), root=1 if bad else 0, name=label)
    if name == "mismatched shape":
        return comm.allreduce(np.ones(4 + bad), name=label)
    if name == "mismatched shape (large)":
        return comm.allreduce(np.ones(1 << 16 + bad, dtype=np.float32), name=label)
    raise ValueError(f"unknown case {name!r}; use one of {CASES}")


def run_job(repeats: int) -> list[dict[str, Any]]:
    """Run inside an MPI job: every case, first-call and steady state, ``repeats`` times."""
    import numpy as np

    import commwire as cw

    comm = cw.init()
    rows = []
    for case in CASES:
        for mode in ("first call", "steady state"):
            raised_all = right_next = 0
            seconds = []
            for i in range(repeats):
                label = f"{case}.{mode}.{i}" if mode == "first call" else f"{case}.{mode}"
                if mode == "steady state" and i == 0:
                    _case(case, comm, label, False)  # the agreed call this name's next calls compare with
                bad = comm.rank == comm.size - 1
                start = time.perf_counter()
                kind = None
                try:
                    _case(case, comm, label, bad)
                except Exception as exc:  # noqa: BLE001 - recording what each rank raised is the point
                    kind = type(exc).__name__
                took = time.perf_counter() - start
                kinds = comm.allgather_object(kind)
                raised_all += all(k is not None for k in kinds) and len(set(kinds)) == 1
                seconds.append(max(comm.allgather_object(took)))
                after = comm.allreduce(np.full(3, comm.rank + 1.0), name="after")
                right_next += bool(np.array_equal(after, np.full(3, comm.size * (comm.size + 1) / 2)))
            rows.append({"case": case, "mode": mode, "ranks": comm.size, "repeats": repeats,
                         "every_rank_raised": raised_all, "next_collective_right": right_next,
                         "slowest_raise_s": max(seconds), "median_raise_s": float(np.median(seconds))})
    return rows


_UNCAUGHT = textwrap.dedent("""
    import time, numpy as np, commwire as cw
    comm = cw.init()
    if comm.rank == comm.size - 2:
        time.sleep(0.5)
        raise RuntimeError("uncaught on purpose")
    comm.allreduce(np.ones(3), name="never completes")
""")


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("no mpiexec found: pip install 'commwire[mpich]'")
    return found


def uncaught(np_: int, repeats: int, limit: float) -> dict[str, Any]:
    """Run ``repeats`` plain-mpiexec jobs where one rank raises uncaught; return how fast they ended."""
    times, ended, named = [], 0, 0
    env = {k: v for k, v in os.environ.items() if k != "COMMWIRE_RUN"}  # plain mpiexec: no commwire run
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "uncaught.py"
        script.write_text(_UNCAUGHT)
        for _ in range(repeats):
            start = time.monotonic()
            try:
                proc = subprocess.run([_mpiexec(), "-n", str(np_), sys.executable, str(script)], env=env,
                                      capture_output=True, text=True, timeout=limit * 6)
                took = time.monotonic() - start
                ended += took <= limit and proc.returncode != 0
                named += f"rank {np_ - 2} of {np_} raised" in proc.stderr and "uncaught on purpose" in proc.stderr
            except subprocess.TimeoutExpired:
                took = float("inf")
            times.append(took)
    return {"ranks": np_, "repeats": repeats, "ended_within_limit": ended, "limit_s": limit,
            "traceback_and_rank_printed": named, "max_s": max(times), "median_s": sorted(times)[len(times) // 2]}


def format_table(rows: list[dict[str, Any]], uncaught_row: dict[str, Any] | None) -> str:
    """Render the results as Markdown."""
    lines = ["| case | call | ranks | every rank raised | next collective right | slowest raise | median |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['mode']} | {r['ranks']} | {r['every_rank_raised']}/{r['repeats']} | "
                     f"{r['next_collective_right']}/{r['repeats']} | {r['slowest_raise_s'] * 1e3:.1f} ms | "
                     f"{r['median_raise_s'] * 1e3:.2f} ms |")
    if uncaught_row is not None:
        u = uncaught_row
        lines += ["", "| uncaught exception, plain mpiexec | ranks | ended within limit | rank and traceback printed |"
                  " slowest | median |", "|---|---|---|---|---|---|",
                  f"| one rank raises, the others wait in a collective | {u['ranks']} | "
                  f"{u['ended_within_limit']}/{u['repeats']} (≤ {u['limit_s']:g} s) | "
                  f"{u['traceback_and_rank_printed']}/{u['repeats']} | {u['max_s']:.1f} s | {u['median_s']:.1f} s |"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench agreement``."""
    parser = argparse.ArgumentParser(prog="commwire bench agreement", description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=4, help="ranks per job (default 4)")
    parser.add_argument("--repeats", type=int, default=20, help="repetitions per case (default 20)")
    parser.add_argument("--limit", type=float, default=10.0, help="seconds an uncaught exception may take (10)")
    parser.add_argument("--skip-uncaught", action="store_true", help="only the caught bad-argument cases")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # inside the MPI job
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the cases in one MPI job and the uncaught-exception jobs; exit 1 if any failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.np < 2 or args.repeats < 1:
        parser.error("--np must be >= 2 and --repeats >= 1")
    if args.job:
        rows = run_job(args.repeats)
        import commwire as cw

        if cw.rank() == 0:
            print(json.dumps(rows))
        return 0
    env = {k: v for k, v in os.environ.items() if k != "COMMWIRE_RUN"}
    proc = subprocess.run([_mpiexec(), "-n", str(args.np), sys.executable, "-m", "commwire.bench.agreement",
                           "--job", "--repeats", str(args.repeats)], env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        return 1
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    uncaught_row = None if args.skip_uncaught else uncaught(args.np, args.repeats, args.limit)
    print(format_table(rows, uncaught_row))
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": rows, "uncaught": uncaught_row}, indent=1))
    ok = all(r["every_rank_raised"] == r["repeats"] == r["next_collective_right"] and r["slowest_raise_s"] < 1.0
             for r in rows) and (uncaught_row is None or uncaught_row["ended_within_limit"] == args.repeats)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
