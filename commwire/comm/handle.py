"""Handles for non-blocking operations."""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from typing import Any, Callable

__all__ = ["Handle", "Done", "Pending", "Blocked", "blocked_seconds", "in_lane", "wait_requests", "wait_yielding",
           "drive", "COLLECTIVE_NAP", "testall", "waitall"]

_local = threading.local()


class _Slot:
    """How deep in commwire's waits a thread is, and the seconds its outermost waits took."""

    __slots__ = ("depth", "total")

    def __init__(self) -> None:
        self.depth = 0
        self.total = 0.0


class _Account(threading.local):
    def __init__(self) -> None:
        self.slot = _Slot()  # one thread-local lookup per wait, then plain attributes


account = _Account()
"""``account.slot`` is the calling thread's :class:`_Slot` (``Communicator._move`` updates it
inline: the fast path of a small all-reduce takes a few microseconds)."""


class Blocked:
    """Count the time the calling thread spends blocked in commwire (a collective, a handle's wait).

    Used around the calls that block (MPI waits, a blocking transport call, a
    future's result), entered and left in the same frame of the same thread:
    never around a collective's steps, which yield to the caller's computation.
    Nested blocks count once: only the outermost adds its duration.
    ``Communicator._move`` does the same inline (the small all-reduce's path).
    """

    __slots__ = ("start",)

    def __enter__(self) -> None:
        acc = account.slot
        acc.depth += 1
        self.start = time.perf_counter() if acc.depth == 1 else None

    def __exit__(self, *exc: Any) -> None:
        acc = account.slot
        acc.depth -= 1
        if self.start is not None:
            acc.total += time.perf_counter() - self.start


def blocked_seconds() -> float:
    """Return the seconds the calling thread has spent blocked in commwire's collectives and waits so far."""
    return account.slot.total


def in_lane() -> bool:
    """Return whether the calling thread is a lane's worker thread."""
    return getattr(_local, "lane", False)


def _mark_lane_thread() -> None:
    _local.lane = True


_YIELDS = 16
"""Tests a lane makes, yielding between them, before it naps (a short message is done by then)."""
_NAP = 100e-6
"""The longest a lane sleeps between later tests; each nap is at most 1/8 of the time waited so
far, so a wait ends at most ~12% (plus the timer's slack) after its requests complete.
Yielding alone still burns the core when the other ranks' threads are the only ones
runnable: on 4 lab hosts sharing 2 cores, ranks whose lanes
spun in sched_yield slowed the others' encoding, and a DDP step with the FP8 hook took 436 ms
against 398 ms with naps (commwire bench ddp setup, interleaved in one job)."""

COLLECTIVE_NAP = 300e-6
"""The longest nap of a lane waiting for a whole collective (MPI's own non-blocking one, or the
ring's steps) rather than for one message of the codec pipeline. The first bucket of a training
step is reduced beside backward, and each wake-up takes a core from it: on 4 lab hosts sharing
2 cores, DistributedOptimizer in FP32 took 1.06-1.07x DDP's step with every lane nap up to 300 us
against 1.12-1.14x with 100 us (3 jobs each, alternated), and 1.04-1.08x with this nap alone
(3 jobs); the codec pipeline, whose messages are short, keeps ``_NAP`` (its FP8 DDP hook took
0.54-0.58x DDP's step with 300 us, 0.52-0.54x with 100 us; 3 jobs each, one seed)."""


def testall(requests: list[Any], statuses: list[Any] | None = None) -> bool:
    """MPI_Testall that raises the failed request's own error, not MPI_ERR_IN_STATUS.

    A fault-tolerant MPI reports a lost peer (ERR_PROC_FAILED, ERR_REVOKED) in the
    status of the request that failed; the error class of the call itself is only
    ERR_IN_STATUS, which would hide the peer loss from ``commwire.elastic``.
    ``statuses``: one ``MPI.Status`` per request, to reuse across tests.
    """
    from mpi4py import MPI

    statuses = [MPI.Status() for _ in requests] if statuses is None else statuses
    try:
        return bool(MPI.Request.Testall(requests, statuses))
    except MPI.Exception as exc:
        raise _in_status(exc, statuses) from exc


def waitall(requests: list[Any]) -> None:
    """MPI_Waitall that raises the failed request's own error, not MPI_ERR_IN_STATUS (see ``testall``)."""
    from mpi4py import MPI

    statuses = [MPI.Status() for _ in requests]
    try:
        with Blocked():
            MPI.Request.Waitall(requests, statuses)
    except MPI.Exception as exc:
        raise _in_status(exc, statuses) from exc


def _in_status(exc: Any, statuses: list[Any]) -> Any:
    from mpi4py import MPI

    if exc.Get_error_class() != MPI.ERR_IN_STATUS:
        return exc
    for status in statuses:
        code = status.Get_error()
        if code not in (MPI.SUCCESS, MPI.ERR_PENDING):
            return MPI.Exception(code)
    return exc


def wait_requests(requests: list[Any], nap: float = _NAP) -> None:
    """Wait for MPI requests; on a lane thread, poll and yield the CPU between tests.

    MPICH busy-polls inside MPI_Wait. On a lane that steals the core the
    caller's computation (backward) needs — badly so when ranks share cores —
    so a lane tests the requests and yields between tests instead, then
    naps between them (at most ``nap``) once the wait is a long one (see ``_NAP``).
    """
    if not in_lane():
        waitall(requests)
        return
    wait_yielding(requests, nap=nap)


def wait_yielding(requests: list[Any], spin: float = 0.0, nap: float = _NAP) -> None:
    """Wait for MPI requests: test them for up to ``spin`` seconds, then yield the CPU between tests, then nap.

    For the lane (which must leave the core to backward) and for waits that
    move no data of their own, as the agreement exchange every collective
    starts with: a rank that arrives first would otherwise spin in MPI for as
    long as the slowest one takes, on a core that ranks sharing it need (see
    ``check.SPIN``). The naps are at most ``nap`` and 1/8 of the time waited.
    """
    from mpi4py import MPI

    spins, start, statuses = 0, time.perf_counter(), [MPI.Status() for _ in requests]
    with Blocked():
        while not testall(requests, statuses):
            waited = time.perf_counter() - start
            if waited < spin:
                continue
            spins += 1
            time.sleep(0 if spins < _YIELDS else min(nap, waited / 8))


def drive(steps: Generator[list[Any], None, Any], wait: Callable[[list[Any]], None]) -> Any:
    """Run a generator of request lists (``Transport.allreduce_steps``) to its end, waiting for each list
    with ``wait``; return the generator's value."""
    try:
        while True:
            wait(next(steps))
    except StopIteration as stop:
        return stop.value


class Handle:
    """A pending operation: ``wait()`` returns its result, ``test()`` polls it.

    The finishing step (dtype conversion, averaging, copying back to the
    caller's device) runs once, when the MPI request completes, so the result
    is built in place in the receive buffer instead of in a second copy.
    """

    __slots__ = ("_requests", "_finish", "_result", "_done", "name", "watch")

    def __init__(self, requests: list[Any], finish: Callable[[], Any], name: str | None = None,
                 watch: tuple[Any, ...] | None = None) -> None:
        self._requests = requests
        self._finish = finish
        self._result: Any = None
        self._done = False
        self.name = name
        self.watch = watch  # (watchdog, communicator id, sequence number, operation) while waiting

    def _complete(self) -> None:
        self._done = True
        self._requests = []
        self._result = self._finish()
        self._finish = _spent

    def test(self) -> bool:
        """Return True once the operation has completed (makes MPI progress)."""
        if self._done:
            return True
        if testall(self._requests):
            self._complete()
            return True
        return False

    def wait(self) -> Any:
        """Block until the operation completes and return its result."""
        if not self._done:  # wait_requests counts as blocked time itself
            if self.watch is None:
                wait_requests(self._requests)
            else:
                watchdog, comm_id, seq, op = self.watch
                token = watchdog.enter(comm_id, seq, op, self.name)
                try:
                    wait_requests(self._requests)
                finally:
                    watchdog.leave(token)
            self._complete()
        return self._result

    @property
    def done(self) -> bool:
        """Whether the result is ready (without making progress)."""
        return self._done

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<commwire.Handle {self.name or ''} {state}>"


def _spent() -> Any:  # pragma: no cover - guards against double completion
    raise RuntimeError("handle already completed")


class Done(Handle):
    """A handle whose operation has already completed."""

    __slots__ = ()

    def __init__(self, result: Any, name: str | None) -> None:
        super().__init__([], lambda: result, name)
        self._complete()


class Pending(Handle):
    """A handle over work another thread completes: ``ready()`` polls it, ``finish()`` waits for it and
    returns the result (a lane's future; a lane handle the caller's CUDA stream then waits for)."""

    __slots__ = ("_ready",)

    def __init__(self, ready: Callable[[], bool], finish: Callable[[], Any], name: str | None) -> None:
        super().__init__([], finish, name)
        self._ready = ready

    def test(self) -> bool:
        """Return True once the work is done (without waiting for it)."""
        if not self._done and self._ready():
            self._complete()
        return self._done

    def wait(self) -> Any:
        """Wait for the work (re-raising its exception) and return the result."""
        if not self._done:
            with Blocked():
                self._complete()
        return self._result
