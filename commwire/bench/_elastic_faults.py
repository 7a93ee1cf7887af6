"""Elastic scenarios of ``commwire bench faults``: training that goes on past a lost host, and grows again.

Each repetition is one elastic job on the emulated lab (``commwire lab up --hosts
4``): ``commwire run --lab -np 4 --min-np 2 --max-np 4 --host-discovery-script
'cat FILE'`` running ``commwire.bench.elastic_job`` (DistributedOptimizer with
ef+fp8-e4m3, LoRDO, or GLM(solver="casgd")). At a random step:

- ``elastic-kill``: every process of one host gets ``kill -9`` (its ranks, its
  launcher proxy) and the host leaves the discovery file;
- ``elastic-cut``: the host's link is cut (``commwire lab cut``) and the host
  leaves the discovery file; the stall watchdog (5 s here) ends the job;
- ``elastic-add``: the job starts on 3 hosts and the fourth is listed.

For kill and cut, the host is listed again (link healed) once training runs on 3.
A repetition passes when training goes on at 3 and comes back to 4, resumes at or
after the last commit before the fault (no committed step lost), every rank's
parameters are bit-identical after every sync (and after every step, where the
optimizer keeps replicas equal), the job finishes, and no process is left on any
lab host. Reported per repetition: seconds from the fault to the first step at 3
(split into detection: the job's end; re-forming: relaunch, process start and the
state sync; the first step), seconds from the rejoin to the first step at 4, and
the final loss (mean of the last 10 steps) against uninterrupted runs' spread.
The lab's 4 hosts share 2 cores: times include starting 4 Python processes on a
loaded machine.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["ELASTIC_SCENARIOS", "run_elastic", "reference_losses", "format_elastic_table"]

ELASTIC_SCENARIOS = ("elastic-kill", "elastic-cut", "elastic-add")
_NAMES = [f"cw-h{i}" for i in range(4)]


def _pids(host: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _write_hosts(path: str, hosts: list[str]) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write("\n".join(hosts) + "\n")
    os.replace(path + ".tmp", path)


def _events(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError):
        return []


def _final_loss(events: list[dict[str, Any]]) -> float | None:
    losses = [e["loss"] for e in events if e["event"] == "step"]
    return statistics.fmean(losses[-10:]) if losses else None


def _job(work: str, job: str, steps: int, seed: int, hosts_file: str) -> tuple[list[str], str, str]:
    log, resets = os.path.join(work, "train.jsonl"), os.path.join(work, "resets.jsonl")
    cmd = [sys.executable, "-m", "commwire", "run", "--lab", "-np", "4", "--min-np", "2", "--max-np", "4",
           "--host-discovery-script", f"cat {hosts_file}", "--blacklist-cooldown-range", "1", "2",
           "--reset-log", resets, "-x", "COMMWIRE_TIMEOUT=5", sys.executable, "-m", "commwire.bench.elastic_job",
           "--log", log, "--steps", str(steps), "--seed", str(seed), "--optimizer", job,
           "--step-sleep", "0.05" if job != "glm" else "0.2", "--commit-every", "5" if job != "glm" else "2"]
    return cmd, log, resets


def reference_losses(job: str, steps: int, seeds: int) -> list[float]:
    """Run the job uninterrupted with seeds 0..seeds-1 (elastic launch, no fault); return their final losses."""
    out = []
    for seed in range(seeds):
        work = tempfile.mkdtemp(prefix="commwire-elastic-ref-")
        hosts_file = os.path.join(work, "hosts.txt")
        _write_hosts(hosts_file, _NAMES)
        cmd, log, _ = _job(work, job, steps, seed, hosts_file)
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        loss = _final_loss(_events(log))
        if loss is not None:
            out.append(loss)
    return out


def run_elastic(scenario: str, rep: int, *, job: str = "sgd", steps: int = 250, rejoin_after: float = 3.0,
                timeout: float = 300.0) -> dict[str, Any]:
    """Run one repetition of ``scenario``; return its record (see the module docstring)."""
    from .. import lab

    work = tempfile.mkdtemp(prefix="commwire-elastic-bench-")
    hosts_file = os.path.join(work, "hosts.txt")
    rng = random.Random(rep)
    victim = rng.choice(_NAMES[1:])  # cw-h0 runs the launcher, as horovodrun's driver host does
    fault_step = rng.randint(8, 30) if job != "glm" else rng.randint(3, 8)
    _write_hosts(hosts_file, [n for n in _NAMES if n != victim] if scenario == "elastic-add" else _NAMES)
    cmd, log, resets = _job(work, job, steps, rep, hosts_file)
    with open(os.path.join(work, "stderr"), "w", encoding="utf-8") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    start = time.time()
    t_fault = t_rejoin = None
    commits_before: list[int] = []
    healed = False
    try:
        while proc.poll() is None and time.time() - start < timeout:
            ev = _events(log)
            steps_seen = [e for e in ev if e["event"] == "step"]
            if t_fault is None and steps_seen and steps_seen[-1]["step"] >= fault_step:
                commits_before = [e["step"] for e in ev if e["event"] == "commit"]
                if scenario == "elastic-add":
                    _write_hosts(hosts_file, _NAMES)
                    t_fault = t_rejoin = time.time()
                else:
                    _write_hosts(hosts_file, [n for n in _NAMES if n != victim])
                    t_fault = time.time()
                    if scenario == "elastic-kill":
                        for pid in _pids(victim):
                            try:
                                os.kill(pid, 9)
                            except ProcessLookupError:
                                pass
                    else:
                        lab.cut(victim)
            elif (t_fault is not None and t_rejoin is None
                  and any(e["event"] == "step" and e["size"] == 3 and e["time"] > t_fault for e in ev)):
                time.sleep(rejoin_after)
                if scenario == "elastic-cut":
                    lab.heal(victim)
                    healed = True
                _write_hosts(hosts_file, _NAMES)
                t_rejoin = time.time()
            time.sleep(0.05)
    finally:
        hung = proc.poll() is None
        if hung:
            proc.kill()
        status = proc.wait()
        if scenario == "elastic-cut" and t_fault is not None and not healed:
            lab.heal(victim)
    time.sleep(1.0)  # a process gone a moment after the job is no orphan
    left = sum(len(_pids(n)) for n in _NAMES)
    ev = _events(log)
    reset_log = _events(resets)
    after = [e for e in ev if t_fault is not None and e["time"] > t_fault]
    synced = [e for e in ev if e["event"] == "synced"]
    first3 = next((e for e in after if e["event"] == "step" and e["size"] == 3), None)
    synced3 = next((e for e in after if e["event"] == "synced" and e["size"] == 3), None)
    first4 = next((e for e in ev if t_rejoin is not None and e["event"] == "step" and e["size"] == 4
                   and e["time"] > t_rejoin), None)
    lost_reset = next((r for r in reset_log if t_fault is not None and r["job_ended"] >= t_fault), None)
    resumed = next((e["step"] for e in after if e["event"] == "synced"), None)
    per_step = job == "sgd"  # LoRDO's replicas differ between its syncs by design; GLM's weights are synced
    agree = all(e["agree"] for e in synced) and (not per_step or all(e["agree"] for e in ev if e["event"] == "step"))
    done = any(e["event"] == "done" for e in ev)
    last_commit = max(commits_before, default=0)
    went_on = scenario == "elastic-add" or first3 is not None
    record = {
        "scenario": scenario, "job": job, "rep": rep, "victim": victim, "fault_step": fault_step,
        "exit": status, "hung": hung, "done": done, "resets": len(reset_log), "orphans": left,
        "to_3_s": first3["time"] - t_fault if first3 and t_fault and scenario != "elastic-add" else None,
        "detect_s": lost_reset["job_ended"] - t_fault if lost_reset and t_fault and scenario != "elastic-add"
        else None,
        "reform_s": synced3["time"] - lost_reset["job_ended"] if synced3 and lost_reset else None,
        "first_step_s": first3["time"] - synced3["time"] if first3 and synced3 else None,
        "rejoin_to_4_s": first4["time"] - t_rejoin if first4 and t_rejoin else None,
        "resumed_at": resumed, "last_commit_before_fault": last_commit,
        "no_commit_lost": resumed is not None and resumed >= last_commit,
        "replicas_agree": agree, "final_loss": _final_loss(ev),
    }
    record["ok"] = bool(not hung and status == 0 and done and went_on and first4 is not None
                        and record["no_commit_lost"] and agree and left == 0)
    record["seconds"] = time.time() - start
    if not record["ok"]:
        with open(os.path.join(work, "stderr"), encoding="utf-8") as fh:
            record["stderr_tail"] = fh.read()[-1500:]
    return record


def format_elastic_table(records: list[dict[str, Any]], reference: dict[str, list[float]]) -> str:
    """Summarise elastic records per (scenario, job) as a Markdown table (median [min, max] seconds)."""
    def span(values: list[float]) -> str:
        vals = [v for v in values if v is not None]
        return f"{statistics.median(vals):.1f} [{min(vals):.1f}, {max(vals):.1f}]" if vals else "-"

    lines = ["| scenario | job | runs | passed | hangs | orphans | no commit lost | replicas agree | fault → step at 3 "
             "(s) | detection | re-forming | first step | rejoin → step at 4 (s) | final loss in the uninterrupted "
             "spread |", "|---" * 14 + "|"]
    for key in dict.fromkeys((r["scenario"], r["job"]) for r in records):
        rs = [r for r in records if (r["scenario"], r["job"]) == key]
        ref = reference.get(key[1], [])
        inside = (f"{sum(min(ref) <= r['final_loss'] <= max(ref) for r in rs if r['final_loss'] is not None)}"
                  f"/{len(rs)} ({min(ref):.4f}–{max(ref):.4f}, {len(ref)} seeds)") if ref else "-"
        lines.append(f"| {key[0]} | {key[1]} | {len(rs)} | {sum(r['ok'] for r in rs)} | {sum(r['hung'] for r in rs)} "
                     f"| {sum(r['orphans'] for r in rs)} | {sum(r['no_commit_lost'] for r in rs)}/{len(rs)} | "
                     f"{sum(r['replicas_agree'] for r in rs)}/{len(rs)} | {span([r['to_3_s'] for r in rs])} | "
                     f"{span([r['detect_s'] for r in rs])} | {span([r['reform_s'] for r in rs])} | "
                     f"{span([r['first_step_s'] for r in rs])} | {span([r['rejoin_to_4_s'] for r in rs])} | "
                     f"{inside} |")
    return "\n".join(lines)
