"""Fault injection: run failing jobs many times and check each ends in time, diagnosed.

Scenarios (each a real ``commwire run`` job of real MPI processes):

- ``kill9``: one rank SIGKILLs itself in the middle of a stream of all-reduces;
- ``raise``: one rank raises an exception between collectives;
- ``stall``: one rank sleeps while the others wait in an all-reduce (watchdog);
- ``linkcut``: on the emulated cluster (``commwire lab up``), one host's link is
  cut while the job runs; the watchdog must name the rank(s) on that host.
- ``resume-ef`` / ``resume-lordo``: a small torch model trains for 24 steps with
  ``DistributedOptimizer(compression="ef+fp8-e4m3")`` (resp. ``LoRDO`` with an
  FP8 wire), saving a ``commwire.checkpoint`` every 4 steps; one rank SIGKILLs
  itself at a random step after the first checkpoint; the job is started again
  with ``commwire run``, resumes from the last checkpoint and trains to the end.
  Each step's data depends only on (step, rank), so the final parameters and
  the whole optimizer state (moments, error-feedback residuals, schedule state)
  must hash bit-identically, on every rank, to an uninterrupted run's.
- ``elastic-kill`` / ``elastic-cut`` / ``elastic-add``: an elastic job on the lab
  (``commwire run --lab --min-np 2 --max-np 4 --host-discovery-script``) loses a
  host (``kill -9`` of its processes; its link cut) or gains one, and must go on
  without losing a committed step, with replicas that agree
  (commwire.bench._elastic_faults; ``--elastic-job sgd|lordo|glm``).

The failing rank is drawn at random per repetition. A repetition passes when the
job exits non-zero within its deadline (timeout + 10 s; a resume job: a watchdog
of at least 30 s plus 90 s for the imports), its report names the failing rank,
and no process of the job is left afterwards; a resume scenario also needs the
restarted job to finish from a checkpoint with the reference hashes.

Run: ``commwire bench faults --repeats 20`` (add ``--scenarios linkcut`` with a lab up,
``--scenarios resume-ef,resume-lordo`` for the crash-and-resume runs,
``--scenarios elastic-kill,elastic-cut,elastic-add`` with a lab of 4 hosts up).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from ._elastic_faults import ELASTIC_SCENARIOS, format_elastic_table, reference_losses, run_elastic
from ._progress import Steps
from ._report import emit

__all__ = ["NAME", "HELP", "DRIVER", "build_parser", "SCENARIOS", "run_fault_bench", "format_table", "main"]

NAME = "faults"
HELP = "kill -9 / raise / stall / link-cut / crash-and-resume jobs: each ends in time, rank named"
DRIVER = True

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

_RESUME_SCRIPT = r'''
import hashlib, json, os, signal, sys
import numpy as np
import torch
import commwire as cw
import commwire.torch as hvd
kind, ckdir, victim, kill_at, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
STEPS, EVERY = int(os.environ["RESUME_STEPS"]), int(os.environ["RESUME_EVERY"])
torch.set_num_threads(1)  # one thread: the same reduction order in every run
cw.init(timeout=float(os.environ.get("FAULT_TIMEOUT", "3")))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
if kind == "resume-ef":
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                   named_parameters=model.named_parameters(), compression="ef+fp8-e4m3")
else:
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=4, sync_every=3, codec="fp8-e4m3")
objs = {"model": model, "opt": opt}
latest, start = os.path.join(ckdir, "latest"), 0
if os.path.exists(latest):
    with open(latest) as fh:
        start = int(fh.read())
    cw.checkpoint.load(os.path.join(ckdir, f"step{start}"), objs)
for step in range(start, STEPS):
    if step == kill_at and cw.rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(1000 * step + cw.rank())  # a step's data depends on (step, rank) only
    x = torch.randn(16, 8, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
    opt.step()
    if (step + 1) % EVERY == 0:
        cw.checkpoint.save(os.path.join(ckdir, f"step{step + 1}"), objs)
        if cw.rank() == 0:  # save() returned: every rank's file is in place
            with open(latest + ".tmp", "w") as fh:
                fh.write(str(step + 1))
            os.replace(latest + ".tmp", latest)

def walk(h, x):
    if isinstance(x, torch.Tensor):
        h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
        h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, np.ndarray):
        h.update(f"A{x.dtype.name}{x.shape}".encode() + np.ascontiguousarray(x).tobytes())
    elif isinstance(x, dict):
        for k, v in x.items():
            h.update(repr(k).encode())
            walk(h, v)
    elif isinstance(x, (list, tuple)):
        h.update(f"{type(x).__name__}{len(x)}".encode())
        for v in x:
            walk(h, v)
    else:
        h.update(repr(x).encode())

digests = {}
for name, obj in objs.items():
    h = hashlib.sha256()
    walk(h, obj.state_dict())
    digests[name] = h.hexdigest()
everyone = cw.allgather_object(digests)
if cw.rank() == 0:
    with open(out, "w") as fh:
        json.dump({"start": start, "digests": everyone}, fh)
'''

_RESUME = {"resume-ef", "resume-lordo"}
_STEPS, _EVERY = 24, 4  # steps of a resume job and checkpoint interval
_RESUME_WATCHDOG = 30.0  # at least: the victim's death is reported by `commwire run`, not by the watchdog,
# and a short one would only trip on ranks still importing torch on a loaded machine
_IMPORT_SLACK = 90.0  # extra seconds per resume job: importing torch and commwire on every rank

SCENARIOS = ("kill9", "raise", "stall", "linkcut", "resume-ef", "resume-lordo") + ELASTIC_SCENARIOS
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


def _run_job(cmd: list[str], env: dict[str, str], deadline: float) -> tuple[int | None, str, bool, float]:
    """Run one job; return (exit code, stderr, hung, seconds), killing it at the deadline."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=deadline)
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        hung = True
    return proc.returncode, err, hung, time.monotonic() - start


def _resume_job(scenario: str, np_: int, ckdir: str, victim: int, kill_at: int, timeout: float,
                workdir: str, token: str) -> tuple[int | None, str, bool, float, dict[str, Any] | None]:
    """Run the training job once (``kill_at`` < 0: no kill); return exit, stderr, hung, seconds, its result."""
    script = os.path.join(workdir, f"{token}.py")
    out = os.path.join(workdir, f"{token}-{time.monotonic_ns()}.json")
    with open(script, "w", encoding="utf-8") as fh:
        fh.write(_RESUME_SCRIPT)
    cmd = [sys.executable, "-m", "commwire", "run", "-np", str(np_), sys.executable, script, scenario, ckdir,
           str(victim), str(kill_at), out]
    env = {**os.environ, "FAULT_TIMEOUT": str(max(timeout, _RESUME_WATCHDOG)), "RESUME_STEPS": str(_STEPS),
           "RESUME_EVERY": str(_EVERY)}
    code, err, hung, seconds = _run_job(cmd, env, _deadline(scenario, timeout))
    result = None
    if os.path.exists(out):
        with open(out, encoding="utf-8") as fh:
            result = json.load(fh)
        os.remove(out)
    return code, err, hung, seconds, result


def _deadline(scenario: str, timeout: float) -> float:
    """Return the seconds one job of ``scenario`` may take."""
    if scenario in _RESUME:
        return max(timeout, _RESUME_WATCHDOG) + _IMPORT_SLACK
    return timeout + 10


def _reference(scenario: str, np_: int, timeout: float, workdir: str) -> list[dict[str, str]]:
    """Train without a fault; return every rank's state hashes."""
    token = f"cwfault-{os.getpid()}-{time.monotonic_ns()}"
    ckdir = tempfile.mkdtemp(prefix="ref-", dir=workdir)
    code, err, hung, _, result = _resume_job(scenario, np_, ckdir, -1, -1, timeout, workdir, token)
    os.remove(os.path.join(workdir, f"{token}.py"))
    shutil.rmtree(ckdir, ignore_errors=True)
    if code != 0 or result is None:
        raise RuntimeError(f"the uninterrupted {scenario} run failed (exit {code}, hung {hung}):\n{err[-3000:]}")
    return result["digests"]


def _one_resume(scenario: str, np_: int, victim: int, kill_at: int, timeout: float, workdir: str,
                reference: list[dict[str, str]]) -> dict[str, Any]:
    """Kill ``victim`` at step ``kill_at``, restart from the last checkpoint, compare with ``reference``."""
    token = f"cwfault-{os.getpid()}-{time.monotonic_ns()}"
    ckdir = tempfile.mkdtemp(prefix="ckpt-", dir=workdir)
    code, err, hung, seconds, _ = _resume_job(scenario, np_, ckdir, victim, kill_at, timeout, workdir, token)
    named = re.search(_EXPECT["kill9"].format(r=victim), err) is not None
    had_checkpoint = os.path.exists(os.path.join(ckdir, "latest"))
    code2, err2, hung2, seconds2, result = _resume_job(scenario, np_, ckdir, victim, -1, timeout, workdir, token)
    time.sleep(1.0)  # a process that is gone a moment after the job is no orphan
    left = _leftovers(token)
    os.remove(os.path.join(workdir, f"{token}.py"))
    shutil.rmtree(ckdir, ignore_errors=True)
    resumed_from = result["start"] if result else None
    identical = result is not None and result["digests"] == reference
    ok = (not hung and not hung2 and code != 0 and named and had_checkpoint and code2 == 0
          and bool(resumed_from) and identical and not left)
    return {"scenario": scenario, "victim": victim, "kill_step": kill_at, "resumed_from": resumed_from,
            "seconds": max(seconds, seconds2), "hung": hung or hung2, "exit": code, "resume_exit": code2,
            "named": named, "orphans": len(left), "identical": identical, "ok": ok,
            "stderr_tail": (err[-700:] + "\n--- resumed job ---\n" + err2[-800:])}


def _cumulative(counts: list[int]) -> list[int]:
    total, out = 0, []
    for c in counts:
        total += c
        out.append(total)
    return out


def run_fault_bench(scenarios: list[str], *, repeats: int = 20, np_: int = 4, timeout: float = 3.0,
                    seed: int = 0, quiet: bool = False, elastic_job: str = "sgd",
                    elastic_steps: int = 250) -> list[dict[str, Any]]:
    """Run every scenario ``repeats`` times with a random victim; return one record per run."""
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise ValueError(f"unknown scenarios {bad}; choose from {', '.join(SCENARIOS)}")
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="commwire-faults-") as workdir, \
            Steps(len(scenarios) * repeats, "faults", quiet=quiet) as steps:
        for scenario in scenarios:
            reference = _reference(scenario, np_, timeout, workdir) if scenario in _RESUME else None
            for i in range(repeats):
                victim = rng.randrange(np_)
                index = len(records)
                steps.start(index, f"{scenario} #{i + 1} (victim rank {victim})")
                if scenario in ELASTIC_SCENARIOS:
                    records.append(run_elastic(scenario, seed + i, job=elastic_job, steps=elastic_steps))
                elif reference is None:
                    records.append(_one(scenario, np_, victim, timeout, workdir))
                else:  # killed at a step after the first checkpoint, never after the last step
                    records.append(_one_resume(scenario, np_, victim, rng.randrange(_EVERY, _STEPS), timeout,
                                               workdir, reference))
                r = records[-1]
                if not quiet or not r["ok"]:
                    steps.finish(index, f"{scenario} #{i + 1}: {'ok' if r['ok'] else 'FAILED'} in "
                                        f"{r['seconds']:.1f} s")
    return records


def format_table(records: list[dict[str, Any]], timeout: float) -> str:
    """Summarise records per scenario as a Markdown table."""
    lines = ["| scenario | runs | passed | hangs | rank named | orphans | max seconds (deadline) | "
             "resumed bit-identical |",
             "|---|---|---|---|---|---|---|---|"]
    for scenario in dict.fromkeys(r["scenario"] for r in records if r["scenario"] not in ELASTIC_SCENARIOS):
        rs = [r for r in records if r["scenario"] == scenario]
        same = f"{sum(r['identical'] for r in rs)}/{len(rs)}" if scenario in _RESUME else "-"
        lines.append(f"| {scenario} | {len(rs)} | {sum(r['ok'] for r in rs)} | {sum(r['hung'] for r in rs)} | "
                     f"{sum(r['named'] for r in rs)}/{len(rs)} | {sum(r['orphans'] for r in rs)} | "
                     f"{max(r['seconds'] for r in rs):.1f} ({_deadline(scenario, timeout):g}) | {same} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench faults``."""
    parser = argparse.ArgumentParser(prog="commwire bench faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="kill9,raise,stall", help=f"comma list of {', '.join(SCENARIOS)}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--np", dest="np_", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=3.0, help="watchdog timeout inside the jobs (s)")
    parser.add_argument("--elastic-job", choices=("sgd", "lordo", "glm"), default="sgd",
                        help="what the elastic scenarios train: DistributedOptimizer(ef+fp8-e4m3), LoRDO, GLM casgd")
    parser.add_argument("--elastic-steps", type=int, default=250, help="steps of each elastic job")
    parser.add_argument("--reference-seeds", type=int, default=3,
                        help="uninterrupted elastic runs whose final-loss spread the elastic runs are held to")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--quiet", action="store_true", help="print only failures and the table")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the scenarios, print the table; exit 1 if any run failed."""
    args = build_parser().parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    records = run_fault_bench(scenarios, repeats=args.repeats, np_=args.np_, timeout=args.timeout,
                              quiet=args.quiet, elastic_job=args.elastic_job, elastic_steps=args.elastic_steps)
    tables = []
    if any(r["scenario"] not in ELASTIC_SCENARIOS for r in records):
        tables.append(format_table(records, args.timeout))
    if any(r["scenario"] in ELASTIC_SCENARIOS for r in records):
        reference = {args.elastic_job: reference_losses(args.elastic_job, args.elastic_steps, args.reference_seeds)}
        tables.append(format_elastic_table(records, reference))
    emit("\n\n".join(tables), records, args.json_path)
    failed = [r for r in records if not r["ok"]]
    for r in failed[:3]:
        print(f"\nFAILED {r['scenario']} victim {r['victim']} (exit {r['exit']}, hung {r['hung']}, "
              f"named {r.get('named', '-')}, orphans {r['orphans']}):\n{r.get('stderr_tail', '')}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
