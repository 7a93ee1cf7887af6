"""Run one of the package's benchmarks as several separate MPI jobs and report each row's spread across jobs.

On a noisy or CPU-bound machine (the emulated lab: 4 ranks on 2 cores) one job's
median can sit a few percent from the next job's: thread placement, the codec
tuner's choice and the link's state differ from job to job. A claim such as
"within 5% of gloo" needs the spread over jobs, not one job. This driver runs

    commwire run [--lab] -np N python -m commwire.bench.NAME ARGS --json JOB.json

``--jobs`` times, one after the other, collects every job's rows and prints, for
each row (keyed by ``--key`` fields), the ``--value`` field of every job, their
median and range and, where ``--within KIND=LIMIT`` gives a limit for the row's
``kind`` (``*``: every row), in how many jobs the value was at most that limit.

Run from a checkout of the repository (a lab up first for ``--lab``):
    python benchmarks/jobs.py --jobs 3 --lab -np 4 --within fp32=1.05,fp8-e4m3=1.10 -- \\
        transports --repeats 7 --sizes 1M,4M,16M,64M
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from commwire.bench.allreduce import _human

DEFAULT_KEY = "ranks,bytes,kind,arm"


def parse_within(text: str) -> dict[str, float]:
    """Return {kind: limit} of ``"fp32=1.05,fp8-e4m3=1.10"``; raise ValueError naming a bad entry."""
    limits: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, value = part.partition("=")
        try:
            limit = float(value) if sep and kind.strip() else float("nan")
        except ValueError:
            limit = float("nan")
        if not limit > 0:
            raise ValueError(f"--within {part!r}: give KIND=LIMIT with a positive limit, e.g. fp32=1.05")
        limits[kind.strip()] = limit
    return limits


def job_argv(bench: list[str], np: int, lab: bool, json_path: Path) -> list[str]:
    """Return the command of one job: ``bench`` is the benchmark's name and its own arguments."""
    name, args = bench[0], bench[1:]
    return [sys.executable, "-m", "commwire", "run", *(["--lab"] if lab else []), "-np", str(np), sys.executable,
            "-m", f"commwire.bench.{name}", *args, "--json", str(json_path)]


def merge(jobs: list[list[dict[str, Any]]], key: list[str], value: str,
          within: dict[str, float]) -> list[dict[str, Any]]:
    """Return one row per key, in the first job's order, with every job's ``value`` and their spread.

    A key missing from some job (a failed size, a different row set) is reported with the jobs
    that have it; ``jobs_within`` counts the values at most the row kind's limit, else ``within["*"]``
    (None: no limit).
    """
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rows in jobs:
        for row in rows:
            missing = [k for k in (*key, value) if k not in row]
            if missing:
                raise ValueError(f"a row has no field {missing[0]!r} (fields: {', '.join(row)}); choose --key and "
                                 "--value among them")
            ident = tuple(row[k] for k in key)
            entry = merged.setdefault(ident, {**{k: row[k] for k in key}, "values": []})
            entry["values"].append(float(row[value]))
    out = []
    for entry in merged.values():
        values = entry["values"]
        limit = within.get(str(entry.get("kind")), within.get("*"))
        out.append({**entry, "median": statistics.median(values), "min": min(values), "max": max(values),
                    "limit": limit, "jobs_within": None if limit is None else sum(v <= limit for v in values)})
    return out


def format_table(rows: list[dict[str, Any]], key: list[str], value: str, jobs: int) -> str:
    """Render the merged rows as a Markdown table."""
    head = [*key, f"{value} per job", "median", "min–max", "jobs within"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        within = "-" if r["limit"] is None else f"{r['jobs_within']}/{len(r['values'])} (≤ {r['limit']:g})"
        cells = [*(_human(r[k]) if k == "bytes" else str(r[k]) for k in key),
                 " / ".join(f"{v:.3f}" for v in r["values"]), f"{r['median']:.3f}", f"{r['min']:.3f}–{r['max']:.3f}",
                 within]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\n{jobs} jobs; a row missing from a job lists only the jobs that have it.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/jobs.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3, help="separate jobs to run (default 3)")
    parser.add_argument("-np", dest="np", type=int, default=4, help="ranks per job")
    parser.add_argument("--lab", action="store_true", help="run each job across the emulated lab (commwire run --lab)")
    parser.add_argument("--key", default=DEFAULT_KEY, help=f"fields that identify a row (default {DEFAULT_KEY})")
    parser.add_argument("--value", default="ratio", help="the field compared across jobs (default ratio)")
    parser.add_argument("--within", default="", help="limits per row kind, e.g. fp32=1.05,fp8-e4m3=1.10 "
                        "('*=1.0': every row without a limit of its own)")
    parser.add_argument("--json", dest="json_path", help="also write the merged rows here")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- NAME [the benchmark's own arguments]")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    try:
        if not bench:
            raise ValueError("name the benchmark after --, e.g. -- transports --sizes 1M")
        if args.jobs < 1 or args.np < 1:
            raise ValueError(f"--jobs {args.jobs} / -np {args.np}: give 1 or more")
        if "--json" in bench:
            raise ValueError("leave --json out of the benchmark's arguments: each job writes its own")
        within = parse_within(args.within)
    except ValueError as exc:
        parser.error(str(exc))
    key = [k.strip() for k in args.key.split(",") if k.strip()]
    results: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="commwire-jobs-") as tmp:
        for i in range(args.jobs):
            path = Path(tmp) / f"job{i}.json"
            cmd = job_argv(bench, args.np, args.lab, path)
            print(f"job {i + 1}/{args.jobs}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0 or not path.exists():
                sys.stderr.write(proc.stderr[-3000:])
                print(f"job {i + 1} failed (exit {proc.returncode}); stopping", file=sys.stderr)
                return 1
            results.append(json.loads(path.read_text(encoding="utf-8")))
    rows = merge(results, key, args.value, within)
    print(format_table(rows, key, args.value, args.jobs))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
