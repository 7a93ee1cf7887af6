"""Fault injection: run failing jobs many times and check each ends in time, diagnosed.

Scenarios (each a real ``commwire run`` job of real MPI processes):

- ``kill9``: one rank SIGKILLs itself in the middle of a stream of all-reduces;
- ``raise``: one rank raises an exception between collectives;
- ``stall``: one rank sleeps while the others wait in an all-reduce (watchdog);
- ``linkcut``: on the emulated cluster (``commwire lab up``), one host's link is
  cut while the job runs; the watchdog must name the rank(s) on that host.

The failing rank is drawn at random per repetition. A repetition passes when the
job exits non-zero within its deadline (timeout + 10 s), its report names the
failing rank, and no process of the job is left afterwards.

Run: ``commwire bench faults --repeats 20`` (add ``--scenarios linkcut`` with a lab up).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from ._report import emit

__all__ = ["SCENARIOS", "run_fault_bench", "format_table", "main"]

_SCRIPT = r'''
import os, signal, sys, time
import numpy as np
import commwire as cw
scenario, victim, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cw.init(timeout=float(os.environ.get("FAULT_TIMEOUT", "3")))
buf = np.ones(1 << 14)
for step in range(100000):
    if step == 30 and cw.rank() == victim:
        if scenario == "kill9":
            os.kill(os.getpid(), signal.SIGKILL)
        elif scenario == "raise":
            raise RuntimeError(f"injected failure on rank {victim}")
        elif scenario == "stall":
            time.sleep(3600)
    if step == 30 and scenario == "linkcut" and cw.rank() == 0:
        open(marker, "w").close()  # tell the driver to cut the link now
    cw.allreduce(buf, name=f"step{step}")
    if scenario == "linkcut" and step > 30:
        time.sleep(0.001)
'''

SCENARIOS = ("kill9", "raise", "stall", "linkcut")
_EXPECT = {
    "kill9": r"rank {r} \(pid \d+ on [^)]+\): died first",
    "raise": r"rank {r} \(pid \d+ on [^)]+\): raised RuntimeError: injected failure on rank {r}",
    "stall": r"missing from this collective: ranks \[{r}\]",
    "linkcut": r"missing from this collective: ranks \[[^\]]*\b{r}\b[^\]]*\]",
}


def _leftovers(token: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", token], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def _one(scenario: str, np_: int, victim: int, timeout: float, workdir: str) -> dict[str, Any]:
    token = f"cwfault-{os.getpid()}-{time.monotonic_ns()}"
    script = os.path.join(workdir, f"{token}.py")
    marker = os.path.join(workdir, f"{token}.go")
    with open(script, "w", encoding="utf-8") as fh:
        fh.write(_SCRIPT)
    cmd = [sys.executable, "-m", "commwire", "run", "-np", str(np_)]
    if scenario == "linkcut":
        cmd.append("--lab")
    cmd += [sys.executable, script, scenario, str(victim), marker]
    env = {**os.environ, "FAULT_TIMEOUT": str(timeout)}
    deadline = timeout + 10
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cut_host = None
    try:
        if scenario == "linkcut":
            from .. import lab

            while not os.path.exists(marker) and proc.poll() is None and time.monotonic() - start < deadline:
                time.sleep(0.01)
            spec = lab.status()
            hosts = lab.placement(np_, spec.hosts)
            owner = next(h for h, upto in enumerate(_cumulative(hosts)) if victim < upto)
            cut_host = spec.names[owner]
            lab.cut(cut_host)
        _, err = proc.communicate(timeout=deadline - (time.monotonic() - start))
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        hung = True
    finally:
        if cut_host is not None:
            from .. import lab

            lab.heal(cut_host)
    elapsed = time.monotonic() - start
    time.sleep(1.0)  # a process that is gone a moment after the job is no orphan
    left = _leftovers(token)
    for path in (script, marker):
        if os.path.exists(path):
            os.remove(path)
    named = re.search(_EXPECT[scenario].format(r=victim), err) is not None
    return {"scenario": scenario, "victim": victim, "seconds": elapsed, "hung": hung,
            "exit": proc.returncode, "named": named, "orphans": len(left),
            "ok": not hung and proc.returncode != 0 and named and not left, "stderr_tail": err[-1500:]}


def _cumulative(counts: list[int]) -> list[int]:
    total, out = 0, []
    for c in counts:
        total += c
        out.append(total)
    return out


def run_fault_bench(scenarios: list[str], *, repeats: int = 20, np_: int = 4, timeout: float = 3.0,
                    seed: int = 0) -> list[dict[str, Any]]:
    """Run every scenario ``repeats`` times with a random victim; return one record per run."""
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise ValueError(f"unknown scenarios {bad}; choose from {', '.join(SCENARIOS)}")
    rng = random.Random(seed)
    records = []
    with tempfile.TemporaryDirectory(prefix="commwire-faults-") as workdir:
        for scenario in scenarios:
            for _ in range(repeats):
                records.append(_one(scenario, np_, rng.randrange(np_), timeout, workdir))
    return records


def format_table(records: list[dict[str, Any]], timeout: float) -> str:
    """Summarise records per scenario as a Markdown table."""
    lines = ["| scenario | runs | passed | hangs | rank named | orphans | max seconds (deadline) |",
             "|---|---|---|---|---|---|---|"]
    for scenario in dict.fromkeys(r["scenario"] for r in records):
        rs = [r for r in records if r["scenario"] == scenario]
        lines.append(f"| {scenario} | {len(rs)} | {sum(r['ok'] for r in rs)} | {sum(r['hung'] for r in rs)} | "
                     f"{sum(r['named'] for r in rs)}/{len(rs)} | {sum(r['orphans'] for r in rs)} | "
                     f"{max(r['seconds'] for r in rs):.1f} ({timeout + 10:g}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the scenarios, print the table; exit 1 if any run failed."""
    parser = argparse.ArgumentParser(prog="commwire bench faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="kill9,raise,stall", help=f"comma list of {', '.join(SCENARIOS)}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--np", dest="np_", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=3.0, help="watchdog timeout inside the jobs (s)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    records = run_fault_bench([s.strip() for s in args.scenarios.split(",") if s.strip()],
                              repeats=args.repeats, np_=args.np_, timeout=args.timeout)
    emit(format_table(records, args.timeout), records, args.json_path)
    failed = [r for r in records if not r["ok"]]
    for r in failed[:3]:
        print(f"\nFAILED {r['scenario']} victim {r['victim']} (exit {r['exit']}, hung {r['hung']}, "
              f"named {r['named']}, orphans {r['orphans']}):\n{r['stderr_tail']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
