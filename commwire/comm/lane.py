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
from collections import deque
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from .handle import Blocked, Handle, Pending, _mark_lane_thread

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Lane", "lane_for", "existing_lane", "close_lane"]


class _FutureHandle(Pending):
    """A handle over work submitted to a lane (``Future.result`` re-raises the worker's exception)."""

    __slots__ = ()

    def __init__(self, future: Future, name: str | None) -> None:
        super().__init__(future.done, future.result, name)


class _Stepped(Handle):
    """A lane's work that the caller's thread drives step by step (``Lane.start``)."""

    __slots__ = ("_steps", "_current", "_error", "lane")

    def __init__(self, lane: Lane, steps: Generator[list[Any], None, Any], name: str | None) -> None:
        super().__init__([], _no_finish, name)
        self.lane = lane
        self._steps: Generator[list[Any], None, Any] | None = steps
        self._current: list[Any] | None = None  # the requests it waits for; None: not started
        self._error: BaseException | None = None

    def test(self) -> bool:
        if not self._done:
            self.lane.progress()
        return self._done

    def wait(self) -> Any:
        if not self._done:
            with Blocked():
                self.lane.finish(self)
        if self._error is not None:
            raise self._error
        return self._result


def _no_finish() -> Any:  # pragma: no cover - a stepped handle completes in Lane._advance
    raise RuntimeError("a stepped handle has no finishing step")


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
        self._queued = 0  # submitted and not finished (stepped work included)
        self._stepping: deque[_Stepped] = deque()  # stepped work, in order; it holds _run_lock while any is here
        self._step_lock = threading.Lock()  # held by the thread advancing the stepped work

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            self.drain()  # stepped work started before this holds the communicator: finish it here
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

    def start(self, steps: Callable[..., Any], whole: Callable[..., Any], *args: Any, label: str | None = None,
              **kwargs: Any) -> Handle:
        """Run ``steps(lane_comm, *args, **kwargs)`` on the calling thread, step by step; return its handle.

        ``steps`` returns a generator that yields each list of the lane transport's requests it
        must see complete before it goes on (``Transport.allreduce_steps``), or None. The caller
        moves it on with ``progress()`` (or the handle's ``test()``) between pieces of its own
        work, and ``wait()`` finishes it: MPI moves data only inside MPI calls, and these calls
        cost the caller a test each instead of a worker thread's wake-ups. Stepped work runs in
        order after everything started before it and before everything submitted after it (the
        worker finishes it first). Where ``steps`` returns None, or work submitted earlier is
        still queued, ``whole(lane_comm, *args, **kwargs)`` runs on the worker, as ``submit``.
        """
        with self._count_lock:
            ours = self._queued == len(self._stepping) and (bool(self._stepping)
                                                             or self._run_lock.acquire(blocking=False))
            if ours:  # no worker job runs or waits: the communicator is the stepped work's
                try:
                    gen = steps(self.comm, *args, **kwargs)
                except Exception:  # noqa: BLE001 - ``whole`` meets the same error, on every rank alike
                    gen = None
                if gen is not None:
                    handle = _Stepped(self, gen, label or kwargs.get("name"))
                    self._queued += 1
                    self._stepping.append(handle)
                elif not self._stepping:
                    self._run_lock.release()
        if not ours or gen is None:
            return self.submit(whole, *args, label=label, **kwargs)
        self.progress()  # start it (and whatever finished before it) now
        return handle

    def progress(self) -> None:
        """Move the stepped work on without blocking (another thread moving it meanwhile: return)."""
        if self._stepping and self._step_lock.acquire(blocking=False):
            try:
                self._advance(False, None)
            finally:
                self._step_lock.release()

    def finish(self, handle: _Stepped) -> None:
        """Block until stepped ``handle`` (and the stepped work before it) has finished."""
        with self._step_lock:  # the steps register their waits with the stall watchdog themselves
            if not handle._done:
                self._advance(True, handle)

    def drain(self) -> None:
        """Block until every stepped work has finished (its errors stay with its handle)."""
        if self._stepping:
            with self._step_lock:
                self._advance(True, None)

    def _advance(self, block: bool, until: _Stepped | None) -> None:
        # Called with _step_lock held; the head of _stepping moves, each in turn.
        transport = self.comm.transport
        while self._stepping and (until is None or not until._done):
            head = self._stepping[0]
            try:
                if head._current is not None:
                    if block:
                        transport.wait_collective(head._current)
                    elif not transport.test(head._current):
                        return
                assert head._steps is not None
                head._current = next(head._steps)
                continue
            except StopIteration as stop:
                head._result = stop.value
            except BaseException as exc:  # noqa: BLE001 - raised by the handle's wait(), on the caller
                head._error = exc
            head._done, head._current, head._steps = True, None, None
            with self._count_lock:
                self._stepping.popleft()
                self._queued -= 1
                if not self._stepping:
                    self._run_lock.release()

    def close(self) -> None:
        """Finish queued work (stepped work included) and stop the worker thread."""
        self._executor.shutdown(wait=True)
        self.drain()


_lanes: dict[int, Lane] = {}
_lock = threading.Lock()


def lane_for(comm: Communicator) -> Lane:
    """Return the lane of ``comm``, creating it (collectively) on first use."""
    with _lock:
        lane = _lanes.get(id(comm))
        if lane is None or lane.parent is not comm:  # an id can be reused once a communicator is gone
            with Blocked():  # the duplicate is collective: a wait for the other ranks
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
