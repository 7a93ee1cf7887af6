"""The elastic driver behind ``commwire run --min-np/--max-np/--host-discovery-script``.

It launches the job on the hosts available, watches the hosts (a discovery
script polled every second, minus hosts blacklisted for a cooldown), and:

* a host added or removed while the job runs: writes a notice the ranks read at
  their next ``commit()`` (``HostsUpdatedInterrupt`` on every rank); in relaunch
  mode every rank then keeps its state in the host's memory and leaves, and the
  driver launches again on the new hosts. In ulfm mode only added hosts are
  announced (a lost host is re-formed in process by the survivors);
* the job fails because a host died (a rank killed without reporting): the
  host is blacklisted for a cooldown, its kept commit is dropped, and the job is
  launched again on the others, which resume from the newest commit they hold;
* a rank raised an exception: that is the program's error, not the cluster's —
  the job ends with it (relaunching would meet the same error);
* the stall watchdog ended the job (a host cut off the network): the job is
  launched again on the hosts the discovery script still lists;
* fewer than ``min_np`` slots for longer than ``elastic_timeout``: the job ends
  with an error naming the hosts it had.

Every reset is recorded (time, cause, hosts before and after) in
``reset_log`` (JSON lines) when given, and printed.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..comm.rankenv import is_this_machine
from ..comm.ranklog import read_statuses
from .spool import host_dir

__all__ = ["ElasticOptions", "DiscoveryError", "discover", "Driver", "check_options"]

Hosts = list[tuple[str, int]]


class DiscoveryError(RuntimeError):
    """The host discovery script failed or printed something that is not ``host[:slots]`` lines."""


@dataclass(kw_only=True)
class ElasticOptions:
    """horovodrun's elastic options, and how the world is re-formed."""

    np: int | None = None
    min_np: int = 1
    max_np: int | None = None
    discovery_script: str | None = None
    hosts: Hosts | None = None  # fixed hosts (-H/--hostfile/--lab) when there is no discovery script
    slots_per_host: int | None = None
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    cooldown: tuple[float, float] | None = None
    mode: str = "relaunch"
    poll: float = 1.0
    reset_log: str | None = None


def check_options(opts: ElasticOptions) -> None:
    """Raise ValueError naming the value and the fix for options that cannot work together."""
    if opts.min_np < 1:
        raise ValueError(f"--min-np {opts.min_np} must be at least 1")
    if opts.max_np is not None and opts.min_np > opts.max_np:
        raise ValueError(f"--min-np {opts.min_np} is larger than --max-np {opts.max_np}; give min-np <= max-np")
    if opts.np is not None and not (opts.min_np <= opts.np <= (opts.max_np or opts.np)):
        raise ValueError(f"-np {opts.np} is outside --min-np {opts.min_np} .. --max-np {opts.max_np}; "
                         "give a starting size between them")
    if opts.discovery_script is None and not opts.hosts:
        raise ValueError("elastic mode needs hosts: give --host-discovery-script (prints host:slots lines), or "
                         "-H/--hostfile/--lab for a fixed set")
    if opts.cooldown is not None and not (0 <= opts.cooldown[0] <= opts.cooldown[1]):
        raise ValueError(f"--blacklist-cooldown-range {opts.cooldown[0]:g} {opts.cooldown[1]:g} must be "
                         "0 <= low <= high seconds")
    if opts.reset_limit is not None and opts.reset_limit < 0:
        raise ValueError(f"--reset-limit {opts.reset_limit} must be >= 0")
    if opts.mode not in ("relaunch", "ulfm"):
        raise ValueError(f"elastic mode {opts.mode!r} is not valid; use relaunch or ulfm")


def discover(script: str, slots_per_host: int | None = None, timeout: float = 30.0) -> Hosts:
    """Run the discovery script and return its ``host[:slots]`` lines as (host, slots) pairs.

    A line without slots gets ``slots_per_host`` (1 if not given); blank lines and ``#``
    comments are skipped.

    Raises:
        DiscoveryError: the script cannot run, exits non-zero, takes longer than ``timeout``,
            or prints a line that is not ``host`` or ``host:slots``.
    """
    try:
        proc = subprocess.run(shlex.split(script), capture_output=True, text=True, timeout=timeout)
    except (OSError, ValueError) as exc:
        raise DiscoveryError(f"host discovery script {script!r} cannot run ({exc}); give an executable that "
                             "prints one host[:slots] per line") from None
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"host discovery script {script!r} took longer than {timeout:g} s; make it "
                             "answer quickly (it is polled every second)") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise DiscoveryError(f"host discovery script {script!r} exited with status {proc.returncode}"
                             f"{': ' + ' | '.join(tail) if tail else ''}; fix it so that it exits 0 and prints "
                             "one host[:slots] per line")
    hosts: Hosts = []
    for number, line in enumerate(proc.stdout.splitlines(), 1):
        text = line.partition("#")[0].strip()
        if not text:
            continue
        host, sep, slots = text.partition(":")
        if not host or " " in host or (sep and not slots.isdigit()) or slots == "0":
            raise DiscoveryError(f"host discovery script {script!r} printed {line!r} on line {number}, which is "
                                 "not host or host:slots (e.g. node1:4)")
        hosts.append((host, int(slots) if sep else (slots_per_host or 1)))
    return hosts


@dataclass
class _Job:
    hosts: Hosts
    np: int
    started: float
    ended: float = 0.0
    status: int = 0


@dataclass
class Driver:
    """Run a job elastically: ``launch(hosts, np, env)`` returns the launcher argv and environment.

    ``spawn(argv, env, watch)`` runs it (``watch()`` is polled while it runs, as
    ``commwire run`` does) and returns the exit status; ``statuses(run_dir)`` reads
    the ranks' status files; ``echo`` prints a line for the person running the job.
    """

    opts: ElasticOptions
    launch: Callable[[Hosts, int, dict[str, str]], tuple[list[str], dict[str, str]]]
    spawn: Callable[[list[str], dict[str, str], Any], int]
    echo: Callable[[str], None]
    resets: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_options(self.opts)
        self.dir = tempfile.mkdtemp(prefix="commwire-elastic-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                    else None)
        self.version = 0
        self.blacklist: dict[str, float] = {}
        self._rng = random.Random()

    # -------------------------------------------------------------- hosts
    def available(self) -> Hosts:
        """Return the hosts that may run ranks now (discovered or fixed, minus blacklisted ones)."""
        now = time.monotonic()
        self.blacklist = {h: until for h, until in self.blacklist.items() if until > now}
        found = (discover(self.opts.discovery_script, self.opts.slots_per_host) if self.opts.discovery_script
                 else list(self.opts.hosts or []))
        return [(h, s) for h, s in found if h not in self.blacklist]

    def _size(self, hosts: Hosts, first: bool) -> int:
        slots = sum(s for _, s in hosts)
        cap = self.opts.max_np or slots
        if first and self.opts.np is not None:
            cap = min(cap, self.opts.np)
        return min(cap, slots)

    def _wait_for_hosts(self, had: Hosts) -> Hosts:
        deadline = time.monotonic() + self.opts.elastic_timeout
        while True:
            hosts = self.available()
            if sum(s for _, s in hosts) >= self.opts.min_np:
                return hosts
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"only {sum(s for _, s in hosts)} slots available ({_fmt(hosts) or 'no hosts'}; blacklisted: "
                    f"{', '.join(self.blacklist) or 'none'}) for {self.opts.elastic_timeout:g} s, fewer than "
                    f"--min-np {self.opts.min_np} (the job last ran on {_fmt(had) or 'no hosts'}); add hosts, "
                    "lower --min-np or raise --elastic-timeout")
            time.sleep(self.opts.poll)

    def _blacklist(self, host: str) -> None:
        low, high = self.opts.cooldown or (float("inf"), float("inf"))
        self.blacklist[host] = time.monotonic() + (self._rng.uniform(low, high) if high != float("inf") else high)
        shutil.rmtree(host_dir(self.dir, host), ignore_errors=True)  # a dead host's memory is gone

    # -------------------------------------------------------------- the loop
    def run(self) -> int:
        """Run the job until it succeeds, fails on its own, or runs out of hosts or resets; return its status."""
        try:
            return self._run()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _run(self) -> int:
        hosts = self._wait_for_hosts([])
        first = True
        while True:
            np_ = self._size(hosts, first)
            used = _take(hosts, np_)
            job = _Job(used, np_, time.time())
            env = {"COMMWIRE_ELASTIC": self.opts.mode, "COMMWIRE_ELASTIC_DIR": self.dir,
                   "COMMWIRE_ELASTIC_VERSION": str(self.version)}
            if self.opts.mode == "ulfm":
                env["COMMWIRE_TIMEOUT"] = "0"  # the MPI detects lost peers; the stall watchdog would abort
            argv, env = self.launch(used, np_, env)
            watch = _HostWatch(self, used)
            run_dir = tempfile.mkdtemp(prefix="commwire-run-")
            try:
                job.status = self.spawn(argv, {**env, "COMMWIRE_RUN_DIR": run_dir}, watch)
                job.ended = time.time()
                statuses = read_statuses(run_dir)
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
            first = False
            if job.status == 0:
                return 0
            finished = [e for e in statuses.values() if e.get("status") == "exited"]
            if self.opts.mode == "ulfm" and finished and len(finished) + len(_silent(statuses)) == len(statuses):
                # the survivors re-formed in process and finished; the launcher counts the lost ranks as failed
                self.echo(f"commwire run: the job finished on {len(finished)} ranks "
                          f"({len(_silent(statuses))} lost and re-formed in process)")
                return 0
            raised = [e for e in statuses.values() if e.get("status") in ("raised", "failed")]
            restarted = any(e.get("status") == "restart" for e in statuses.values())
            stalled = [e for e in statuses.values() if e.get("status") == "stalled"]
            if raised and not restarted:
                return job.status  # the program's own error: `commwire run` reported it
            lost = [] if restarted or stalled else _lost_hosts(statuses, used)
            for host in lost:
                self._blacklist(host)
            cause = ("hosts updated" if restarted else f"host lost: {', '.join(lost)}" if lost
                     else f"stalled: {stalled[0].get('detail', '')[:120]}" if stalled
                     else f"job failed (status {job.status}) without a rank to blame")
            if self.opts.reset_limit is not None and len(self.resets) >= self.opts.reset_limit:
                self.echo(f"commwire run: reset limit {self.opts.reset_limit} reached ({cause}); ending the job")
                return job.status or 1
            try:
                hosts = self._wait_for_hosts(used)
            except RuntimeError as exc:
                self.echo(f"commwire run: {exc}")
                return job.status or 1
            after = _take(hosts, self._size(hosts, False))
            record = {"time": job.ended, "cause": cause, "hosts_before": _fmt(used), "hosts_after": _fmt(after),
                      "np_before": np_, "np_after": sum(s for _, s in after), "job_ended": job.ended,
                      "relaunched": time.time()}
            self.resets.append(record)
            self.echo(f"commwire run: reset {len(self.resets)}: {cause}; {_fmt(used)} -> {_fmt(after)}")
            if self.opts.reset_log:
                with open(self.opts.reset_log, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(record) + "\n")
            self.version += 1


class _HostWatch:
    """Polled by ``spawn`` while a job runs: tells the ranks when the hosts differ from the job's."""

    done = False  # never finished: the job ends by itself

    def __init__(self, driver: Driver, used: Hosts) -> None:
        self.driver, self.used = driver, dict(used)
        self.next = time.monotonic() + driver.opts.poll
        self.announced = False

    def __call__(self) -> int | None:
        if self.announced or time.monotonic() < self.next:
            return None
        self.next = time.monotonic() + self.driver.opts.poll
        try:
            now = dict(self.driver.available())
        except DiscoveryError as exc:
            self.driver.echo(f"commwire run: {exc} (keeping the current hosts)")
            return None
        removed = [h for h in self.used if h not in now]
        used_np = sum(self.used.values())
        cap = self.driver.opts.max_np or sum(now.values())
        grows = min(cap, sum(now.values())) > used_np and any(h not in self.used or now[h] > self.used[h]
                                                            for h in now)
        if self.driver.opts.mode == "ulfm":
            removed = []  # a lost host is re-formed in process; announce only growth
        if not removed and not grows:
            return None
        self.driver.version += 1
        notice = {"version": self.driver.version, "removed_only": bool(removed) and not grows}
        tmp = os.path.join(self.driver.dir, "hosts.json.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(notice, fh)
        os.replace(tmp, os.path.join(self.driver.dir, "hosts.json"))
        self.announced = True
        return None


def _take(hosts: Hosts, np_: int) -> Hosts:
    """Return the first hosts, in order, with as many slots as ``np_`` ranks need."""
    out, left = [], np_
    for host, slots in hosts:
        if left <= 0:
            break
        out.append((host, min(slots, left)))
        left -= min(slots, left)
    return out


def _fmt(hosts: Hosts) -> str:
    return ",".join(f"{h}:{s}" for h, s in hosts)


def _silent(statuses: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the ranks that died without reporting (killed, or stopped by the launcher)."""
    return [e for e in statuses.values() if e.get("status", "running") == "running" and "died" in e]


def _lost_hosts(statuses: dict[str, dict[str, Any]], used: Hosts) -> list[str]:
    """Return the host of the rank that died first without reporting (killed), if the status files tell.

    The rank's status names its host as the host knows itself; where the hosts were given
    otherwise (addresses, say), the launcher's placement tells: it fills each host's slots in
    order. A rank that died on the machine the driver runs on blames no host: that one is alive.
    Ranks whose status files this machine cannot see (another host, no shared filesystem)
    blame nobody: the discovery script is then what drops a dead host.
    """
    silent = _silent(statuses)
    if not silent:
        return []
    first = min(silent, key=lambda e: e["died"])
    host = first.get("host")
    if host in dict(used):
        return [host]
    placed = [h for h, slots in used for _ in range(slots)]
    rank = str(first.get("rank", ""))
    if rank.isdigit() and int(rank) < len(placed) and not is_this_machine(placed[int(rank)]):
        return [placed[int(rank)]]
    return []
