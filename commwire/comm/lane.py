"""A background lane: collectives that run on a worker thread, in call order.

MPICH makes progress on a non-blocking collective only while some MPI call
runs, so an ``Iallreduce`` started during backward mostly moves when it is
finally waited on. A lane instead runs blocking collectives on one worker
thread (mpi4py releases the GIL inside MPI, torch inside its kernels), so the
transfer really overlaps the caller's computation.

The lane owns a duplicate of the communicator, so its collectives never
interleave with the ones the caller issues meanwhile; a single worker keeps
them in submission order, which every rank reproduces. Needs MPI thread level
"multiple" (commwire's default).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from .handle import Handle, _mark_lane_thread

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Lane", "lane_for", "existing_lane", "close_lane"]


class _FutureHandle(Handle):
    """A handle over work submitted to a lane."""

    __slots__ = ("_future",)

    def __init__(self, future: Future, name: str | None) -> None:
        super().__init__([], future.result, name)
        self._future = future

    def test(self) -> bool:
        if not self._done and self._future.done():
            self._complete()
        return self._done

    def wait(self) -> Any:
        if not self._done:
            self._complete()  # future.result() blocks, and re-raises the worker's exception
        return self._result


class Lane:
    """Run functions of a communicator on one background thread, in order.

    ``call`` runs a function on the caller's thread instead when nothing is
    queued (a blocking collective then pays no thread hand-off), still in
    order with everything submitted: one lock admits one function at a time,
    and work is queued only behind work that came first.
    """

    def __init__(self, comm: Communicator) -> None:
        from mpi4py import MPI

        self.parent = comm

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "background collectives need MPI thread level 'multiple'; "
                "call commwire.init(thread_level='multiple') (the default)"
            )
        self.comm = comm.derive(comm.mpi.Dup())
        self.comm.transport.lane = True  # its waits yield the CPU (see MPITransport)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="commwire-lane", initializer=_mark_lane_thread)
        self._run_lock = threading.Lock()  # held while a function of this lane runs, on any thread
        self._count_lock = threading.Lock()
        self._queued = 0  # submitted and not finished

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            with self._run_lock:
                return fn(self.comm, *args, **kwargs)
        finally:
            with self._count_lock:
                self._queued -= 1

    def submit(self, fn: Callable[..., Any], *args: Any, label: str | None = None, **kwargs: Any) -> Handle:
        """Run ``fn(lane_comm, *args, **kwargs)`` on the lane; return a handle (named ``label``) to its result."""
        with self._count_lock:
            self._queued += 1
            future = self._executor.submit(self._run, fn, args, kwargs)
        return _FutureHandle(future, label or kwargs.get("name"))

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(lane_comm, *args, **kwargs)`` after the work queued so far and return its result."""
        with self._count_lock:
            idle = self._queued == 0 and self._run_lock.acquire(blocking=False)
            if idle:
                self._queued += 1  # work submitted from now on queues behind this call
        if not idle:
            return self.submit(fn, *args, **kwargs).wait()
        try:
            return fn(self.comm, *args, **kwargs)
        finally:
            self._run_lock.release()
            with self._count_lock:
                self._queued -= 1

    def close(self) -> None:
        """Finish queued work and stop the worker thread."""
        self._executor.shutdown(wait=True)


_lanes: dict[int, Lane] = {}
_lock = threading.Lock()


def lane_for(comm: Communicator) -> Lane:
    """Return the lane of ``comm``, creating it (collectively) on first use."""
    with _lock:
        lane = _lanes.get(id(comm))
        if lane is None or lane.parent is not comm:  # an id can be reused once a communicator is gone
            lane = _lanes[id(comm)] = Lane(comm)
        return lane


def existing_lane(comm: Communicator) -> Lane | None:
    """Return the lane of ``comm`` if it has one (never creates one: that would be collective)."""
    with _lock:
        lane = _lanes.get(id(comm))
        return lane if lane is not None and lane.parent is comm else None


def close_lane(comm: Communicator) -> None:
    """Finish the queued work of ``comm``'s lane (if it has one) and stop it."""
    with _lock:
        lane = _lanes.get(id(comm))
        if lane is None or lane.parent is not comm:
            return
        del _lanes[id(comm)]
    lane.close()
