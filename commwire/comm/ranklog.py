"""Per-rank status files, so ``commwire run`` can say which rank failed and how.

``commwire run`` gives every rank a directory (COMMWIRE_RUN_DIR). Each rank
writes ``rank-N.json`` when it starts and overwrites it when it ends: cleanly,
with an exception, or aborted by the stall watchdog. A rank killed outright
(SIGKILL, the OOM killer, a crash in native code) cannot write anything, and
the launcher then kills the others the same way; so each rank also leaves a
tiny guardian process that notes the moment its rank died. The rank that died
first is the culprit. Ranks on other hosts are covered when the directory is
on a shared filesystem (and their clocks agree).
"""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any

from .. import _config
from .rankenv import host_id, launcher_ranks

__all__ = ["record", "start_guardian", "summarize", "read_statuses", "env_rank"]


def env_rank() -> str:
    """Return this process's rank as the launcher announced it (before MPI starts), or ``"?"``."""
    rank = launcher_ranks().rank
    return "?" if rank is None else str(rank)


def record(status: str, detail: str = "") -> None:
    """Write this rank's status file, if the job was started by ``commwire run``."""
    run_dir = _config.env_str("COMMWIRE_RUN_DIR")
    if not run_dir or not os.path.isdir(run_dir):
        return
    rank = env_rank()
    entry = {"rank": rank, "pid": os.getpid(), "host": host_id(), "status": status, "detail": detail}
    path = os.path.join(run_dir, f"rank-{rank}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(entry, fh)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except OSError:
        pass  # reporting must never be the reason a rank fails


def start_guardian() -> None:
    """Fork a guardian that records when this rank's process dies, then exits.

    Call before MPI or any thread starts (forking is safe then). The guardian
    leaves the rank's session, so a launcher that kills the rank's process
    group does not take it along; it exits as soon as it has written the time.
    """
    run_dir = _config.env_str("COMMWIRE_RUN_DIR")
    if not run_dir or not os.path.isdir(run_dir) or not hasattr(os, "pidfd_open"):
        return
    parent, rank = os.getpid(), env_rank()
    try:
        pidfd = os.pidfd_open(parent)
    except OSError:
        return
    if os.fork() != 0:
        os.close(pidfd)
        return
    try:  # the guardian: no Python cleanup, no atexit, just wait and write
        os.setsid()
        select.select([pidfd], [], [])  # readable once the parent has exited
        with open(os.path.join(run_dir, f"death-{rank}"), "w", encoding="utf-8") as fh:
            fh.write(repr(time.time()))
    finally:
        os._exit(0)


def read_statuses(run_dir: str) -> dict[str, dict[str, Any]]:
    """Return each rank's last status entry (and ``died``: when its guardian saw it die), by rank."""
    entries: dict[str, dict[str, Any]] = {}
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        try:
            if name.startswith("rank-") and name.endswith(".json"):
                with open(path, encoding="utf-8") as fh:
                    entry = json.load(fh)
                entries.setdefault(str(entry["rank"]), {}).update(entry)
            elif name.startswith("death-"):
                with open(path, encoding="utf-8") as fh:
                    entries.setdefault(name[len("death-"):], {})["died"] = float(fh.read())
        except (OSError, ValueError, KeyError):
            continue
    return entries


def summarize(run_dir: str, np_: int) -> list[str]:
    """Return one line per rank that did not exit cleanly, the culprits first."""
    entries = read_statuses(run_dir)
    silent = {r: e for r, e in entries.items() if e.get("status", "running") == "running" and "died" in e}
    reported = any(e.get("status") in ("raised", "failed", "stalled") for e in entries.values())
    first = None if reported or not silent else min(silent, key=lambda r: silent[r]["died"])
    lines = []
    order = {"raised": 0, "failed": 0, "stalled": 1}
    for rank, e in sorted(entries.items(), key=lambda kv: (kv[0] != first, order.get(kv[1].get("status"), 2),
                                                             kv[1].get("died", 0.0))):
        where = f"rank {rank} (pid {e.get('pid', '?')} on {e.get('host', '?')})"
        status = e.get("status", "running")
        if status == "raised":
            lines.append(f"{where}: raised {e['detail']}")
        elif status == "failed":  # a program run by `_rankmain --exec` exited non-zero
            lines.append(f"{where}: {e['detail']}")
        elif status == "stalled":
            lines.append(f"{where}: the stall watchdog aborted the job; {e['detail']}")
        elif rank == first:
            lines.append(f"{where}: died first, without reporting: killed by a signal (SIGKILL, OOM killer) "
                         "or crashed in native code")
        elif status == "running" and "died" in e:
            after = f" {e['died'] - silent[first]['died']:.3f} s later" if first is not None else ""
            lines.append(f"{where}: stopped by the launcher{after}")
    missing = [str(r) for r in range(np_) if str(r) not in entries]
    if missing:
        lines.append(f"ranks {', '.join(missing)}: never started Python (or their host does not share "
                     f"{run_dir})")
    return lines
