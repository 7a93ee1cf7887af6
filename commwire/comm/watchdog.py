"""Stall watchdog: report a collective that some rank never joins, then abort.

Every rank runs one daemon thread with its own duplicate of the world
communicator. Collectives register what they are doing (communicator id,
sequence number, operation, tensor name, start time) in a table read by the
thread. When one of this rank's collectives has waited longer than the
timeout, the thread asks every other rank's thread for its table over the
duplicate communicator, names the ranks that are not inside the same
collective (and what they are doing instead, or that they did not answer),
and aborts the job — or only warns, if configured.

A rank whose program ends (``finalize()``, also at interpreter exit) tells the
other ranks' threads first. A rank still waiting in a collective of a
communicator that includes a finished rank can never complete it (its peers
took different paths: a loop that ended early on some ranks, say), so once the
wait has outlasted ``FINISHED_GRACE`` seconds after the notice it is reported
and aborted at once instead of after the full timeout.

The threads answer each other even while the main threads are blocked inside
MPI, so a diagnosis needs no cooperation from the stuck code. A rank that is
stopped (SIGSTOP) or holds the GIL without releasing it cannot answer; it is
reported as not answering.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import Any

__all__ = ["Watchdog", "StallReport"]

_QUERY, _REPLY, _EXIT = 7701, 7702, 7703
_perf = time.perf_counter
FINISHED_GRACE = 2.0
"""Seconds a collective may still wait after a member rank announced the end of its program (messages
it sent just before may still be in flight)."""


class StallReport(RuntimeError):
    """A collective waited longer than the timeout; the message names the missing ranks."""


class Watchdog:
    """Watch this rank's collectives and diagnose the ones that stall."""

    def __init__(self, mpi_world: Any, *, timeout: float, action: str = "abort", poll: float = 0.05,
                 reply_timeout: float | None = None) -> None:
        from mpi4py import MPI

        if action not in ("abort", "warn"):
            raise ValueError(f"on_stall={action!r} is not valid; use 'abort' or 'warn'")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds (0 disables the watchdog at init)")
        self._MPI = MPI
        self.comm = mpi_world.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        # How long to wait for the other ranks' answers: a rank cut off the network
        # never answers, and the report should not take much longer than the stall.
        reply_timeout = min(5.0, max(1.0, timeout / 2)) if reply_timeout is None else reply_timeout
        self.timeout, self.action, self.poll, self.reply_timeout = timeout, action, poll, reply_timeout
        self._active: dict[int, tuple[str, int, str, str | None, float]] = {}
        self._tokens = itertools.count()
        self._last: tuple[str, int, str, str | None, float] | None = None
        self._reported: set[int] = set()
        self._groups: dict[str, Any] = {}  # communicator id -> its MPI group (for its members' world ranks)
        self._finished: dict[int, float] = {}  # rank -> when its end-of-program notice arrived
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.reports: list[str] = []
        self._thread = threading.Thread(target=self._run, name="commwire-watchdog", daemon=True)
        self._thread.start()

    def register(self, comm_id: str, mpi_comm: Any) -> None:
        """Remember which ranks communicator ``comm_id`` spans (once per communicator, not per call)."""
        self._groups[comm_id] = mpi_comm.Get_group()

    def _members(self, comm_id: str) -> set[int]:
        group = self._groups.get(comm_id)
        if group is None:
            return set(range(self.size))
        ranks = group.Translate_ranks(list(range(group.Get_size())), self.comm.Get_group())
        return {r for r in ranks if r != self._MPI.UNDEFINED}

    def announce_exit(self) -> None:
        """Tell every other rank's watchdog that this rank's program has ended (waits at most 1 s)."""
        requests = [self.comm.isend(None, dest=r, tag=_EXIT) for r in range(self.size) if r != self.rank]
        deadline = _perf() + 1.0
        while requests and not self._MPI.Request.testall(requests)[0] and _perf() < deadline:
            time.sleep(0.001)

    # ----------------------------------------------------------- hot path
    def enter(self, comm_id: str, seq: int, op: str, name: str | None) -> int:
        """Record that a collective started; return a token for :meth:`leave`."""
        token = next(self._tokens)
        self._active[token] = (comm_id, seq, op, name, _perf())
        return token

    def leave(self, token: int) -> None:
        """Record that the collective of ``token`` completed."""
        entry = self._active.pop(token, None)
        if entry is not None:
            self._last = entry

    # ------------------------------------------------------------ thread
    def _state(self) -> dict[str, Any]:
        now = _perf()
        active = [(c, s, op, n, now - t0) for c, s, op, n, t0 in list(self._active.values())]
        last = self._last
        return {"rank": self.rank, "active": active,
                "last": None if last is None else (last[0], last[1], last[2], last[3])}

    def _answer_queries(self) -> None:
        status = self._MPI.Status()
        while self.comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=_QUERY, status=status):
            self.comm.recv(source=status.Get_source(), tag=_QUERY)
            self.comm.send(self._state(), dest=status.Get_source(), tag=_REPLY)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll):
                self._answer_queries()
                self._receive_exits()
                now = _perf()
                stalled = [(tok, e) for tok, e in list(self._active.items())
                           if now - e[4] > self.timeout and tok not in self._reported]
                orphaned = [] if stalled or not self._finished else self._orphaned(now)
                if stalled or orphaned:
                    token, entry, gone = (*stalled[0], []) if stalled else orphaned[0]
                    self._reported.add(token)
                    self._diagnose(entry, finished=gone)
        except Exception as exc:  # noqa: BLE001 - the watchdog must never take the job down by itself
            if not self._stop.is_set():
                sys.stderr.write(f"commwire watchdog on rank {self.rank} stopped: {exc!r}\n")

    def _receive_exits(self) -> None:
        status = self._MPI.Status()
        while self.comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=_EXIT, status=status):
            src = status.Get_source()
            self.comm.recv(source=src, tag=_EXIT)
            self._finished.setdefault(src, _perf())

    def _orphaned(self, now: float) -> list[tuple[int, tuple[str, int, str, str | None, float], list[int]]]:
        """Return this rank's collectives that wait for a rank whose program has ended (after the grace)."""
        found = []
        for tok, entry in list(self._active.items()):
            if tok in self._reported:
                continue
            gone = sorted(r for r, at in self._finished.items()
                          if now - max(at, entry[4]) > FINISHED_GRACE and r in self._members(entry[0]))
            if gone:
                found.append((tok, entry, gone))
        return found

    def _diagnose(self, entry: tuple[str, int, str, str | None, float], finished: list[int] = ()) -> None:
        comm_id, seq, op, name, t0 = entry
        # Non-blocking sends: a dead or stopped peer must not stall the diagnosis. Finished ranks cannot answer.
        pending = [self.comm.isend(None, dest=r, tag=_QUERY) for r in range(self.size)
                   if r != self.rank and r not in self._finished]
        replies: dict[int, dict[str, Any]] = {self.rank: self._state()}
        expected = self.size - len([r for r in self._finished if r != self.rank])
        deadline = _perf() + self.reply_timeout
        status = self._MPI.Status()
        while len(replies) < expected and _perf() < deadline:
            self._answer_queries()  # others may be diagnosing at the same time
            if self.comm.Iprobe(source=self._MPI.ANY_SOURCE, tag=_REPLY, status=status):
                src = status.Get_source()
                replies[src] = self.comm.recv(source=src, tag=_REPLY)
            else:
                time.sleep(0.005)
        del pending
        text = self._report(comm_id, seq, op, name, _perf() - t0, replies, finished)
        self.reports.append(text)
        sys.stderr.write(text)
        sys.stderr.flush()
        if self.action == "abort":
            from .ranklog import record

            from .runtime import abort_world

            record("stalled", text.splitlines()[-2].strip())
            abort_world(3)

    def _report(self, comm_id: str, seq: int, op: str, name: str | None, waited: float,
                replies: dict[int, dict[str, Any]], finished: list[int] = ()) -> str:
        label = f"{op} {name!r}" if name else op
        why = (f"ranks {list(finished)} of this collective have ended their program" if finished
               else f"timeout {self.timeout:g} s")
        members = self._members(comm_id)
        span = "every rank" if len(members) == self.size else f"world ranks {sorted(members)}"
        lines = [f"commwire watchdog: rank {self.rank} has waited {waited:.1f} s in {label} "
                 f"(collective #{seq} on communicator {comm_id}, {span}); {why}"]
        missing = []
        for r in sorted(members):
            reply = replies.get(r)
            if r in self._finished and r != self.rank:
                missing.append(r)
                lines.append(f"  rank {r}: program ended (finalize or exit) without joining this collective; "
                             "the ranks took different paths through the program")
                continue
            if reply is None:
                missing.append(r)
                lines.append(f"  rank {r}: no answer within {self.reply_timeout:g} s (stopped, dead, or "
                             "holding the GIL)")
                continue
            inside = [a for a in reply["active"] if a[0] == comm_id and a[1] == seq]
            if inside:
                lines.append(f"  rank {r}: in the same collective for {inside[0][4]:.1f} s")
                continue
            missing.append(r)
            doing = "; ".join(f"{a[2]} {a[3]!r} (#{a[1]} on {a[0]}) for {a[4]:.1f} s" for a in reply["active"])
            last = reply["last"]
            last_text = f"last completed {last[2]} {last[3]!r} (#{last[1]} on {last[0]})" if last else \
                "no collective completed yet"
            lines.append(f"  rank {r}: {'in ' + doing if doing else 'not in any collective'}; {last_text}")
        lines.append(f"  missing from this collective: ranks {missing}")
        lines.append("  aborting the job (set on_stall='warn' / COMMWIRE_ON_STALL=warn to only report)\n"
                     if self.action == "abort" else "  continuing to wait (on_stall='warn')\n")
        return "\n".join(lines)

    def close(self) -> None:
        """Stop the thread (collectively: every rank frees its duplicate communicator)."""
        self._stop.set()
        self._thread.join(timeout=5 * self.poll + 1)
        self.comm.Free()
