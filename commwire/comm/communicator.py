"""Collectives over a group of ranks for numpy, torch and cupy arrays.

A ``Communicator`` validates each collective's arguments without raising and
runs it under the agreement protocol (commwire.comm.protocol: an error any rank
finds is raised on every rank together) over MPI, its control plane; the data
itself moves over a transport (commwire.comm.transport): the same MPI
communicator by default, or a ``torch.distributed`` process group
(``Communicator.from_process_group``, ``commwire.init(transport="torch")``).
What each call sends and receives on this rank, and the checks of its
arguments, are prepared in commwire.comm.buffers.

Moves that need no arithmetic (broadcast, allgather, alltoall) travel as raw
bytes, so every dtype works. Reductions of float16/bfloat16 run in float32 and
are rounded back once (commwire.comm.reduce). Non-blocking variants run the
blocking collective on the communicator's background lane (commwire.comm.lane),
on a duplicate communicator, so they make progress while the caller computes
and never interleave with the caller's own collectives.

Device arrays (torch CUDA tensors, cupy arrays; commwire.comm.arrays) take one
of two paths in every collective: where the transport takes device buffers
(a CUDA-aware MPI with ``cuda_aware=True``; an NCCL group) they go to it
directly, otherwise they are staged through host memory. Both send the same
messages, so the choice is each rank's own; what the messages are (dtype on the
wire, reduction) depends only on the agreed signature. Reductions prepare their
work buffer on the device in both paths, and float min/max of device arrays
travel as order-preserving integers reduced by the transport's own MIN/MAX
(a Python-defined MPI op would read device memory as host memory).
"""

from __future__ import annotations

import time
import weakref
import zlib
from collections.abc import Generator
from typing import Any, Callable

import numpy as np

from .arrays import DeviceOps, dtype_name, stream_order
from .check import exchange
from .buffers import (Reduction, as_bytes, check_out, cpu_tensor_view, describe, device_of, dtype_of_name, empty,
                      landing, nbytes_of, op_label, plain_out, ready_bytes, row_counts, same_view, send_buffer,
                      splits_of, tensor_of, wire_of)
from .handle import Blocked, Done, Handle, Pending, drive
from .handle import account as blocked_account
from .protocol import FUSED_BYTES, JOINABLE, Agreed, AgreementProtocol, Signature
from .reduce import REDUCE_OPS, flag_values, normalize_op
from .stats import Counters
from .timeline import Timeline
from .transport import MPITransport, Transport

__all__ = ["Communicator", "REDUCE_OPS", "Signature", "live_communicators"]

_perf = time.perf_counter
_live: weakref.WeakSet[Communicator] = weakref.WeakSet()  # for switching the timeline of every communicator
_from_group_count: dict[str, int] = {}  # communicators made over each set of ranks by from_process_group


def _ranks_label(ranks: list[int]) -> str:
    """Name a set of ranks alike on every process (short: the ranks themselves up to 8, else a checksum)."""
    if len(ranks) <= 8:
        return "-".join(map(str, ranks))
    return f"{len(ranks)}r{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"


class Communicator(AgreementProtocol):
    """Run collectives on a group of ranks.

    Args:
        mpi_comm: the mpi4py communicator of these ranks (e.g. ``MPI.COMM_WORLD``): the control plane,
            and the data's transport unless ``transport`` is given.
        transport: what moves the data (commwire.comm.transport); default: ``mpi_comm`` itself.
        counters: where to record operation counts, bytes and times.
        check: how ranks agree on a collective's arguments (commwire.comm.protocol):
            True before every call (and ``join()`` works), "first" (default) on
            the first call of each (operation, name) and by a flag afterwards,
            False never.
        timeline: optional Chrome-trace recorder.
        cuda_aware: hand CUDA buffers straight to MPI instead of staging them (MPI transport).

    Example:
        >>> comm = commwire.world()
        >>> comm.allreduce(np.ones(3), op="avg")
    """

    def __init__(
        self,
        mpi_comm: Any,
        *,
        transport: Transport | None = None,
        counters: Counters | None = None,
        check: bool | str = "first",
        timeline: Timeline | None = None,
        cuda_aware: bool = False,
        watchdog: Any = None,
        uid: str = "world",
    ) -> None:
        self._init_protocol(check)
        self.mpi = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        if transport is None:
            transport = MPITransport(mpi_comm, cuda_aware=cuda_aware)
        self.transport: Transport = transport
        if (self.transport.rank, self.transport.size) != (self.rank, self.size):
            raise ValueError(f"the transport's ranks ({self.transport!r}) do not match MPI's (rank {self.rank} of "
                             f"{self.size}); build the process group over the same ranks in the same order")
        self.counters = counters if counters is not None else Counters()
        self.timeline = timeline
        self.cuda_aware = cuda_aware
        self._node: Communicator | None = None
        self.watchdog = watchdog
        self.uid = uid  # the same on every member: names this communicator in stall reports
        if watchdog is not None:
            watchdog.register(uid, mpi_comm)
        self._seq = 0
        self._derived: dict[str, int] = {}  # communicators derived from this one, by their members
        _live.add(self)

    @classmethod
    def from_process_group(cls, pg: Any, *, comm: Communicator | None = None, check: bool | str | None = None
                           ) -> Communicator:
        """Return a communicator whose data moves over torch.distributed process group ``pg``.

        Call it on every member of ``pg`` (only there). Its control plane is an MPI communicator
        over the same ranks, made from ``comm`` (default: the world), whose ranks must be
        torch.distributed's global ranks (as when commwire started torch.distributed).
        """
        from .runtime import default_comm
        from .torch_transport import TorchTransport, process_group_ranks

        base = default_comm(comm)
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call commwire.init(transport='torch') or "
                               "commwire.torch.init_process_group() first")
        if dist.get_world_size() != base.size or dist.get_rank() != base.rank:
            raise ValueError(f"torch.distributed numbers this process rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, but commwire's communicator has it as rank {base.rank} of "
                             f"{base.size}; start torch.distributed with MPI's ranks "
                             "(commwire.torch.init_process_group does)")
        if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"rank {base.rank} is not a member of the process group (torch gave it "
                             f"{pg!r}); call from_process_group only on its members")
        ranks = process_group_ranks(pg)
        if base.rank not in ranks:
            raise ValueError(f"rank {base.rank} is not a member of the process group (ranks {ranks}); call "
                             "from_process_group only on its members")
        group = base.mpi.Get_group().Incl(ranks)
        try:
            mpi_sub = base.mpi.Create_group(group)
        finally:
            group.Free()
        # Named alike on every member (and apart from the other communicators over these ranks):
        # the groups derived from it (its lane's) are named after it.
        label = _ranks_label(ranks)
        count = _from_group_count[label] = _from_group_count.get(label, 0) + 1
        uid = f"{base.uid}/pg{label}.{count}"
        prefix = getattr(base.transport, "prefix", "commwire")
        return Communicator(mpi_sub, transport=TorchTransport(pg, prefix=prefix, label=uid), counters=base.counters,
                            check=base.check if check is None else check, timeline=base.timeline,
                            cuda_aware=base.cuda_aware, watchdog=base.watchdog, uid=uid)

    def __repr__(self) -> str:
        return f"<commwire.Communicator rank {self.rank} of {self.size} over {self.transport.name}>"

    def join(self) -> int:
        """Take part in the other ranks' all-reduces with zeros until every rank has joined.

        For uneven data: a rank that has run out of batches calls ``join()``
        and the others keep training; their all-reduces count it as zeros
        (averages still divide by the full size, as in Horovod). Other
        collectives raise on the ranks that call them while some rank has
        joined. Needs ``check=True`` (every collective starts with the
        exchange that tells a joined rank what the others do).

        Returns:
            The rank that joined last (the same on every rank; the highest of
            those that joined together).
        """
        if self.check is not True:
            raise RuntimeError("join() needs a communicator that agrees on every collective: create it with "
                               "check=True (commwire.torch's process sets are), or call the collectives on every rank")
        rounds = 0
        while True:
            with self.watched("join"):
                rnd = exchange(self.mpi, None, None, joined_for=rounds)
            if rnd.everyone_joined:
                return max(r for r, n in enumerate(rnd.joined_for) if n == 0)
            sig = rnd.sig
            if sig is not None and sig[0] == "allreduce" and sig[4] in JOINABLE:
                n, wdt, rop, _ = self._reduction_of(sig)
                self._move("allreduce", sig[1], self.transport.allreduce, None, np.zeros(n, dtype=wdt), rop)
            rounds += 1

    # ---------------------------------------------------------------- helpers
    def _move(self, opname: str, name: str | None, move: Callable[..., Any], *args: Any) -> Any:
        """Run one data movement of the transport, registered with the stall watchdog; return its result."""
        watchdog, acc = self.watchdog, blocked_account.slot
        acc.depth += 1  # counted as blocked time (Blocked, inline: this is the small all-reduce's path)
        start = _perf() if acc.depth == 1 else None
        try:
            if watchdog is None:
                return move(*args)
            self._seq += 1
            token = watchdog.enter(self.uid, self._seq, opname, name)
            try:
                return move(*args)
            finally:
                watchdog.leave(token)
        finally:
            acc.depth -= 1
            if start is not None:
                acc.total += _perf() - start

    def _record(self, opname: str, name: str | None, nbytes: int, start: float) -> None:
        end = _perf()
        self.counters.record(opname, nbytes, end - start)
        if self.timeline is not None:
            self.timeline.add(name or opname, start, end, op=opname, bytes=nbytes)

    def watched(self, opname: str, name: str | None = None) -> Any:
        """Return a context manager that registers a blocking wait with the stall watchdog."""
        return _Watched(self, opname, name)

    def submit(self, method: Callable[..., Any], *args: Any, label: str | None = None, **kwargs: Any) -> Handle:
        """Run ``method(lane_comm, *args, **kwargs)`` on this communicator's background lane; return its handle.

        The lane runs submissions one at a time, in order, on a duplicate of
        this communicator (every rank must submit the same collectives in the
        same order). Without MPI thread level "multiple" it runs them at once.
        CUDA arrays among the arguments order the lane's device work after the
        work queued on this thread's current stream, and the handle's
        ``wait()`` makes the waiting thread's stream wait for it
        (``commwire.comm.arrays.StreamOrder``). ``label`` names the handle
        (default: the ``name`` argument).
        """
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            # No background lane without thread level "multiple": run now (a completed handle
            # keeps every rank's order of collectives intact).
            return Done(method(self, *args, **kwargs), label or kwargs.get("name"))
        from .lane import lane_for

        order = stream_order(*args, *kwargs.values())
        if order is None:
            return lane_for(self).submit(method, *args, label=label, **kwargs)
        inner = lane_for(self).submit(_in_order, order, method, *args, label=label, **kwargs)
        return Pending(inner.test, lambda: order.join(inner.wait()), inner.name)  # the caller's stream waits

    def start(self, steps: Callable[..., Any], whole: Callable[..., Any], *args: Any, label: str | None = None,
              **kwargs: Any) -> Handle:
        """Like ``submit(whole, ...)``, but where ``steps(lane_comm, ...)`` gives a generator of request lists
        (e.g. ``lane_comm.allreduce_steps(...)``), the calling thread runs it, step by step (``Lane.start``).

        Call ``progress()`` between pieces of computation to move it on; the handle's
        ``wait()`` finishes it. Device arrays among the arguments go to ``submit``.
        """
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return Done(whole(self, *args, **kwargs), label or kwargs.get("name"))
        if stream_order(*args, *kwargs.values()) is not None:
            return self.submit(whole, *args, label=label, **kwargs)
        from .lane import lane_for

        return lane_for(self).start(steps, whole, *args, label=label, **kwargs)

    def progress(self) -> None:
        """Move the work started with ``start`` on, without blocking (cheap when there is none)."""
        from .lane import existing_lane

        lane = existing_lane(self)
        if lane is not None:
            lane.progress()

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``method(lane_comm, *args, **kwargs)`` in order with the lane's work and return its result.

        When the lane is idle it runs on the calling thread (no hand-off to the
        worker); otherwise it waits for the work submitted before it.
        """
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return method(self, *args, **kwargs)
        from .lane import lane_for

        order = stream_order(*args, *kwargs.values())
        if order is None:
            return lane_for(self).call(method, *args, **kwargs)
        return order.join(lane_for(self).call(_in_order, order, method, *args, **kwargs))

    # ------------------------------------------------------------- allreduce
    def allreduce(self, x: Any, op: str = "sum", *, out: Any = None, name: str | None = None) -> Any:
        """Reduce ``x`` over all ranks and return the result on every rank.

        Args:
            x: numpy array, torch tensor or cupy array (any supported dtype).
            op: ``"sum"``, ``"avg"``, ``"min"``, ``"max"``, ``"prod"`` or ``"adasum"``.
            out: optional array of x's shape and dtype to write the result into; ``out=x`` reduces in place.
            name: label for the timeline, statistics and the agreement check.

        Returns:
            The reduced array, of the same kind, dtype, shape and device as ``x``.
        """
        # Fast path for the common case (a contiguous numpy array, or a CPU torch tensor through
        # its numpy view, whose signature was agreed before, or with check=False met before on
        # this rank): the general path costs several microseconds of Python, as much as a small
        # MPI_Allreduce itself (8 B, 2 ranks: a tensor took 19.6 us by the general path, 7.1 us
        # by this one, numpy 5.0-5.7 us).
        agreed = self._fast_entry(x, op, out, name)
        if agreed is not None:
            return self._allreduce_fast(agreed, x, out, name)
        if type(x) is np.ndarray:
            if type(out) is np.ndarray and out is not x and same_view(out, x):  # in place through another view
                agreed = self._fast_entry(x, op, x, name)
                if agreed is not None:
                    self._allreduce_fast(agreed, x, x, name)
                    return out
        else:
            view = cpu_tensor_view(x, out)
            if view is not None:
                view_out = view if out is x else None
                agreed = self._fast_entry(view, op, view_out, name)
                if agreed is not None:  # a CPU tensor takes the numpy fast path through its own memory
                    result = self._allreduce_fast(agreed, view, view_out, name)
                    return x if view_out is not None else tensor_of(result)
        return self._allreduce(x, op, out, name)

    def _fast_entry(self, x: Any, op: str, out: Any, name: str | None) -> Agreed | None:
        """Return the agreed entry (``check=False``: the known one) when ``allreduce(x, op, out=out, name=name)``
        may take the fast path."""
        if type(x) is np.ndarray and self.check is not True and self.timeline is None:
            agreed = (self._agreed if self.check else self._known).get(("allreduce", name))
            if (agreed is not None and agreed.op == op and x.dtype == agreed.dtype and x.shape == agreed.shape
                    and x.flags.c_contiguous and (out is None or out is x or (
                        agreed.fused is not None and type(out) is np.ndarray and out.shape == x.shape
                        and out.dtype == x.dtype and out.flags.writeable) or plain_out(out, x))):
                return agreed
        return None

    def allreduce_async(self, x: Any, op: str = "sum", *, out: Any = None, name: str | None = None) -> Handle:
        """Start an all-reduce on the background lane; the handle's ``wait()`` gives the result."""
        return self.submit(Communicator.allreduce, x, op, out=out, name=name)

    def allreduce_steps(self, x: Any, op: str = "sum", *, out: Any = None,
                        name: str | None = None) -> Generator[list[Any], None, Any] | None:
        """Return ``allreduce(x, op, out=out, name=name)`` as a generator of the request lists it waits for, or None.

        The generator's value (``StopIteration.value``, or ``yield from``) is the result; drive it
        with ``Communicator.start``. None where this call must run whole: anything but a numpy
        array, Adasum, a transport that moves the data itself (``Transport.steps``), or, on a
        communicator that agrees on first calls (``check="first"``), a call whose signature was
        not agreed yet. A stepped call sends what a whole one does, so ranks may drive the same
        call either way (one steps, another runs it on the lane).
        """
        if type(x) is not np.ndarray or not self.transport.steps or op == "adasum":
            return None
        if self.check is True:
            return self._checked_steps(x, op, out, name)
        agreed = self._fast_entry(x, op, out, name)
        if agreed is None:
            return None
        if self.check is False:
            return self._unchecked_steps(agreed, x, out, name)
        if agreed.fused is not None:
            return self._fused_steps(agreed, x, out, name)
        return self._plain_steps(agreed, x, out, name)

    def _checked_steps(self, x: np.ndarray, op: str, out: Any, name: str | None) -> Generator[list[Any], None, Any]:
        """``_allreduce`` on a communicator that agrees on every call (``check=True``), in steps."""
        start = _perf()
        plan, error, sig = self._plan(x, op, out, name)
        yield from self._agree_steps(sig, error)  # raises on every rank if any rank's arguments are wrong or differ
        assert plan is not None
        recv, send = plan.buffers()
        with self.watched("allreduce", name):  # as _allreduce's _move: the watchdog sees the same collectives
            yield from self.transport.allreduce_steps(send, recv, plan.mop)
        result = plan.finish(recv)
        self._record("allreduce", name, plan.nbytes, start)
        return result

    def _fused_steps(self, agreed: Agreed, x: np.ndarray, out: Any,
                     name: str | None) -> Generator[list[Any], None, Any]:
        """The fast path's small all-reduce (the flag in the buffer), in steps, in a buffer of its own."""
        start = _perf()
        n, wdt, mop, valid, _, average = agreed.fused
        buf = np.empty(n + 1, dtype=wdt)
        np.copyto(buf[:n].reshape(x.shape), x)
        buf[n] = valid
        with self.watched("allreduce", name):  # as _allreduce_fast's _move
            yield from self.transport.allreduce_steps(None, buf, mop)
        result = buf[:n].reshape(x.shape)
        return self._fast_finish(agreed, x, out, name, result, buf.item(n) != valid, average, start)

    def _allreduce_fast(self, agreed: Agreed, x: np.ndarray, out: Any, name: str | None) -> Any:
        if self.check is False:
            return self._allreduce_unchecked(agreed, x, out, name)
        start = _perf()
        if agreed.fused is not None:  # the deviation flag rides in the buffer (reused: one copy in, one out)
            n, wdt, mop, valid, _, average = agreed.fused
            if agreed.pad is None:
                agreed.pad = np.empty(n + 1, dtype=wdt)
                agreed.head = agreed.pad[:n].reshape(x.shape)
            buf, head = agreed.pad, agreed.head
            np.copyto(head, x)
            buf[n] = valid
            self._move("allreduce", name, self.transport.allreduce_small, buf, mop)
            flagged = buf.item(n) != valid
            if not flagged:
                if average:
                    np.divide(head, self.size, out=head)
                if out is None:
                    result = head.copy()
                else:
                    np.copyto(out, head)
                    result = out
                self.counters.record("allreduce", x.nbytes, _perf() - start)
                return result
            result = head
        else:  # a tiny all-reduce of the flag travels beside the data (the steps register with the watchdog)
            return drive(self._plain_steps(agreed, x, out, name), self.transport.wait_collective)
        return self._fast_finish(agreed, x, out, name, result, flagged, average, start)

    def _plain_steps(self, agreed: Agreed, x: np.ndarray, out: Any,
                     name: str | None) -> Generator[list[Any], None, Any]:
        """The fast path's all-reduce of a large array, in steps (``allreduce_steps``); returns the result.

        Run whole (``drive``) or stepped, it registers the same waits with the stall watchdog.
        """
        start = _perf()
        mop, average = agreed.plain
        result, send = landing(x, out)
        with self.watched("allreduce", name):
            flag = self._flag_start(False)
            try:
                with self._flag_beside(flag):
                    yield from self.transport.allreduce_steps(send, result, mop)
            finally:
                flagged = self._flag_wait(flag, agreed.sig)
        return self._fast_finish(agreed, x, out, name, result, flagged, average, start)

    def _allreduce_unchecked(self, agreed: Agreed, x: np.ndarray, out: Any, name: str | None) -> Any:
        """The fast path of a communicator that does not agree (``check=False``): the data alone, no flag."""
        if agreed.fused is None:
            return drive(self._unchecked_steps(agreed, x, out, name), self.transport.wait_collective)
        start = _perf()  # small: reduced in place (in x, out or a copy), without the ring test or a hand-off
        buf, send = landing(x, out)
        if send is not None:
            np.copyto(buf, send)
        self._move("allreduce", name, self.transport.allreduce_small, buf, agreed.plain[0])
        return self._fast_finish(agreed, x, out, name, buf, False, agreed.plain[1], start)

    def _unchecked_steps(self, agreed: Agreed, x: np.ndarray, out: Any,
                         name: str | None) -> Generator[list[Any], None, Any]:
        """``_allreduce_unchecked`` in steps (``allreduce_steps``); returns the result."""
        start = _perf()
        mop, average = agreed.plain
        result, send = landing(x, out)
        with self.watched("allreduce", name):
            yield from self.transport.allreduce_steps(send, result, mop)
        return self._fast_finish(agreed, x, out, name, result, False, average, start)

    def _fast_finish(self, agreed: Agreed, x: np.ndarray, out: Any, name: str | None, result: Any, flagged: bool,
                     average: bool, start: float) -> Any:
        if flagged:  # another rank deviated: the exchange raises here as there
            self._agree(agreed.sig, None)
            raise RuntimeError(f"allreduce {name!r}: a rank flagged different arguments but the exchange found "
                               "none; the ranks' records of agreed collectives differ (call the same collectives "
                               "in the same order on every rank)")
        if average:
            np.divide(result, self.size, out=result)
        if out is not None and result is not out:
            np.copyto(out, result)
            result = out
        self.counters.record("allreduce", x.nbytes, _perf() - start)
        return result

    def _plan(self, x: Any, op: str, out: Any,
              name: str | None) -> tuple[Reduction | None, BaseException | None, Signature]:
        """Return an all-reduce's plan (None if its arguments are bad), the error that found, and its signature."""
        plan: Reduction | None = None
        error = None
        try:
            plan = Reduction(x, op, out, self.transport, self.size)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it (see run_collective)
            error = exc
        sig = plan.sig(name) if plan is not None else Signature("allreduce", name, *describe(x), op_label(op),
                                                                device=device_of(x))
        return plan, error, sig

    def _allreduce(self, x: Any, op: str, out: Any, name: str | None) -> Any:
        start = _perf()
        plan, error, sig = self._plan(x, op, out, name)
        allreduce = self.transport.allreduce

        def run() -> Any:
            assert plan is not None
            if plan.op == "adasum":
                return plan.finish(self._adasum(plan.work))
            recv, sendbuf = plan.buffers()
            self._move("allreduce", name, allreduce, sendbuf, recv, plan.mop)
            return plan.finish(recv)

        def dummy(agreed_sig: tuple[Any, ...]) -> None:
            n, wdt, mop, op_name = self._reduction_of(agreed_sig)
            zeros = np.zeros(n, dtype=wdt)
            if op_name == "adasum":
                self._adasum(zeros)
            else:
                self._move("allreduce", name, allreduce, None, zeros, mop)

        def fused(agreed: Agreed, deviates: bool) -> tuple[Any, bool]:
            n, wdt, mop, valid, deviating, _ = agreed.fused
            if deviates:
                buf = np.zeros(n + 1, dtype=wdt)
                buf[n] = deviating
            else:  # this rank's signature is the agreed one: its work buffer has the wire dtype
                assert plan is not None
                buf = plan.fused_buffer(n, valid)
            self._move("allreduce", name, allreduce, None, buf, mop)
            if deviates or plan is None or plan.flag(buf, n) != valid:
                return None, True
            return plan.finish(buf[:n].reshape(plan.shape)), False

        # Which path a call takes depends only on the agreed entry, never on this rank's arguments,
        # so every rank takes the same one.
        result = self.run_collective(sig, error, run, dummy, fused)
        if self.check is False and plan is not None:  # valid here: later calls like it take the fast path
            self._know(("allreduce", name), sig)
        self._record("allreduce", name, plan.nbytes if plan is not None else 0, start)
        return result

    def _adasum(self, work: np.ndarray) -> np.ndarray:
        from .adasum import adasum_allreduce

        with self.watched("allreduce adasum"), Blocked():
            return adasum_allreduce(self.mpi, np.ascontiguousarray(work))

    # ------------------------------------------------------------- allgather
    def allgather(self, x: Any, *, name: str | None = None) -> Any:
        """Concatenate every rank's ``x`` along the first dimension (sizes may differ)."""
        start = _perf()
        error = send = adapter = dev = dtype = None
        try:
            dev, send, dtype, adapter = send_buffer(self.transport, x)
            if send.ndim == 0:
                send = send.reshape(1)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = exc
        trailing = tuple(send.shape[1:]) if send is not None else describe(x)[0]
        sig = Signature("allgather", name, trailing, dtype_name(dtype) if send is not None else describe(x)[1],
                        device=device_of(x))
        transport = self.transport

        def gather(rows: int, buf: Any, row_shape: tuple[int, ...], dtype: np.dtype, dev: DeviceOps | None) -> Any:
            counts = np.empty(self.size, dtype=np.int64)
            self._move("allgather sizes", name, transport.allgather, np.array([rows], dtype=np.int64), counts)
            row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
            recv = empty(dev, (int(counts.sum()),) + row_shape, dtype, buf)
            nbytes = counts * row_bytes
            self._move("allgather", name, transport.allgatherv, ready_bytes(dev, buf), as_bytes(dev, recv), nbytes)
            return recv

        def run() -> Any:
            assert send is not None and dtype is not None
            recv = gather(send.shape[0], send, tuple(send.shape[1:]), dtype, dev)
            if dev is not None:
                return recv
            assert adapter is not None
            adapter.release(send)
            return adapter.wrap(recv, x)

        def dummy(agreed_sig: tuple[Any, ...]) -> None:
            gather(0, np.empty(0, dtype=np.uint8), tuple(agreed_sig.shape), dtype_of_name(agreed_sig.dtype), None)

        result = self.run_collective(sig, error, run, dummy)
        self._record("allgather", name, int(send.nbytes) if send is not None else 0, start)
        return result

    def allgather_async(self, x: Any, *, name: str | None = None) -> Handle:
        """Start an all-gather; the handle's ``wait()`` returns the concatenation."""
        return self.submit(Communicator.allgather, x, name=name)

    # ------------------------------------------------------------- broadcast
    def broadcast(self, x: Any, root: int = 0, *, out: Any = None, name: str | None = None) -> Any:
        """Return root's ``x`` on every rank (every rank passes an array of that shape)."""
        start = _perf()
        error = send = adapter = dev = np_dtype = None
        try:
            self._check_root(root)
            dev, send, np_dtype, adapter = send_buffer(self.transport, x)
            check_out(x, out, "broadcast")
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = exc
        shape, dtype = (tuple(send.shape), dtype_name(np_dtype)) if send is not None else describe(x)
        sig = Signature("broadcast", name, shape, dtype, root=root, device=device_of(x))

        def run() -> Any:
            assert send is not None
            if dev is not None:
                return self._bcast_device(dev, x, send, np_dtype, root, out, name)
            assert adapter is not None
            if out is x and adapter.kind == "numpy":
                buf = send
            elif self.rank == root:
                buf = send.copy()
            else:
                buf = np.empty_like(send)
            self._bcast(buf, root, name)
            adapter.release(send)
            if out is not None:
                return adapter.write(out, buf)
            return adapter.wrap(buf, x)

        def dummy(agreed_sig: tuple[Any, ...]) -> None:
            self._bcast(np.zeros(nbytes_of(agreed_sig.shape, agreed_sig.dtype), dtype=np.uint8), agreed_sig.root, name)

        result = self.run_collective(sig, error, run, dummy)
        self._record("broadcast", name, int(send.nbytes) if send is not None else 0, start)
        return result

    def broadcast_async(self, x: Any, root: int = 0, *, out: Any = None, name: str | None = None) -> Handle:
        """Start a broadcast from ``root``; the handle's ``wait()`` returns the array."""
        return self.submit(Communicator.broadcast, x, root, out=out, name=name)

    def _bcast(self, buf: np.ndarray, root: int, name: str | None) -> None:
        self._move("broadcast", name, self.transport.broadcast, buf.reshape(-1).view(np.uint8), root)

    def _bcast_device(self, dev: DeviceOps, x: Any, send: Any, dtype: np.dtype, root: int, out: Any,
                      name: str | None) -> Any:
        """Broadcast a device array with device buffers (CUDA-aware MPI)."""
        if out is x and dev.is_contiguous(x):
            buf = send  # x's own memory: broadcast in place
        elif self.rank == root:
            buf = dev.clone(send)
        else:
            buf = dev.empty(tuple(send.shape), dtype, send)
        self._move("broadcast", name, self.transport.broadcast, ready_bytes(dev, buf), root)
        if out is None:
            return buf
        if buf is not send:
            dev.copy_into(out, buf)
        return out

    # -------------------------------------------------------- reduce_scatter
    def reduce_scatter(self, x: Any, op: str = "sum", *, name: str | None = None, counts: Any = None) -> Any:
        """Reduce ``x`` over ranks and return this rank's block of rows.

        Rows are split as ``numpy.array_split`` does (the first ``len(x) % size``
        ranks get one row more) unless ``counts`` gives each rank's number of
        rows (the same list on every rank, summing to ``len(x)``).
        """
        start = _perf()
        error = plan = rows = None
        try:
            if normalize_op(op) == "adasum":
                raise NotImplementedError("reduce_scatter does not support op='adasum'; use allreduce(op='adasum')")
            plan = Reduction(x, op, None, self.transport, self.size)
            if plan.work.ndim == 0:
                raise ValueError("reduce_scatter needs an array with at least one dimension, got a scalar; "
                                 "reshape it to (1,) or use allreduce")
            rows = row_counts(counts, plan.work.shape[0], self.size)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error, plan = exc, None
        sig = plan.sig(name, "reduce_scatter") if plan is not None else Signature(
            "reduce_scatter", name, *describe(x), op_label(op), device=device_of(x))
        if counts is not None:
            sig = sig._replace(counts=tuple(int(c) for c in np.asarray(counts).reshape(-1)))

        def scatter(work: Any, mop: Any, rows: np.ndarray, recv: Any = None) -> Any:
            row_elems = int(np.prod(tuple(work.shape[1:]), dtype=np.int64))
            if recv is None:
                recv = np.empty((int(rows[self.rank]),) + tuple(work.shape[1:]), dtype=work.dtype)
            self._move("reduce_scatter", name, self.transport.reduce_scatter, work, recv, rows * row_elems, mop)
            return recv

        def run() -> Any:
            assert plan is not None and rows is not None
            send = plan.mpi_send()
            recv = plan.mpi_empty((int(rows[self.rank]),) + tuple(plan.work.shape[1:]))
            try:
                return plan.finish(scatter(send, plan.mop, rows, recv))
            finally:
                plan.release(send)

        def dummy(agreed_sig: tuple[Any, ...]) -> None:
            _, wdt, mop, _ = self._reduction_of(agreed_sig)
            zeros = np.zeros(agreed_sig.shape, dtype=wdt)
            scatter(zeros, mop, row_counts(agreed_sig.counts, zeros.shape[0], self.size))

        result = self.run_collective(sig, error, run, dummy)
        self._record("reduce_scatter", name, plan.nbytes if plan is not None else 0, start)
        return result

    def reduce_scatter_async(self, x: Any, op: str = "sum", *, name: str | None = None, counts: Any = None
                             ) -> Handle:
        """Start a reduce-scatter; the handle's ``wait()`` returns this rank's block."""
        return self.submit(Communicator.reduce_scatter, x, op, name=name, counts=counts)

    # --------------------------------------------------------------- alltoall
    def alltoall(self, x: Any, *, name: str | None = None) -> Any:
        """Send block i of ``x``'s rows to rank i; return the blocks received, in rank order."""
        return self.alltoallv(x, None, name=name)[0]

    def alltoall_async(self, x: Any, *, name: str | None = None) -> Handle:
        """Start an all-to-all; the handle's ``wait()`` returns the received blocks."""
        return self.submit(Communicator.alltoall, x, name=name)

    def alltoallv(self, x: Any, splits: Any = None, *, name: str | None = None) -> tuple[Any, np.ndarray]:
        """Send ``splits[i]`` rows of ``x`` to rank i (in order); return (rows received, rows from each rank).

        With ``splits=None`` the first dimension is split equally (it must be
        divisible by the number of ranks). Rows beyond ``sum(splits)`` are not sent.
        """
        start = _perf()
        error = send = adapter = counts = dev = np_dtype = None
        try:
            dev, send, np_dtype, adapter = send_buffer(self.transport, x)
            counts = splits_of(send, splits, self.size)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = exc
        shape, dtype = (tuple(send.shape[1:]), dtype_name(np_dtype)) if send is not None and send.ndim else \
            describe(x)
        sig = Signature("alltoall", name, shape, dtype, device=device_of(x))
        transport = self.transport

        def exchange_rows(rows: np.ndarray, buf: Any, row_shape: tuple[int, ...], dtype: np.dtype,
                          dev: DeviceOps | None) -> tuple[Any, np.ndarray]:
            received = np.empty(self.size, dtype=np.int64)
            self._move("alltoall sizes", name, transport.alltoall_counts, rows, received)
            row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
            recv = empty(dev, (int(received.sum()),) + row_shape, dtype, buf)
            self._move("alltoall", name, transport.alltoallv, ready_bytes(dev, buf), rows * row_bytes,
                       as_bytes(dev, recv), received * row_bytes)
            return recv, received

        def run() -> Any:
            assert send is not None and counts is not None and np_dtype is not None
            recv, received = exchange_rows(counts, send, tuple(send.shape[1:]), np_dtype, dev)
            if dev is not None:
                return recv, received
            assert adapter is not None
            adapter.release(send)
            return adapter.wrap(recv, x), received

        def dummy(agreed_sig: tuple[Any, ...]) -> None:
            exchange_rows(np.zeros(self.size, dtype=np.int64), np.empty(0, dtype=np.uint8), tuple(agreed_sig.shape),
                          dtype_of_name(agreed_sig.dtype), None)

        result = self.run_collective(sig, error, run, dummy)
        self._record("alltoall", name, int(send.nbytes) if send is not None else 0, start)
        return result

    # ---------------------------------------------------------------- objects
    def broadcast_object(self, obj: Any, root: int = 0, *, name: str | None = None) -> Any:
        """Return root's picklable ``obj`` on every rank."""
        start = _perf()
        error = None
        try:
            self._check_root(root)
        except ValueError as exc:
            error = exc

        def move(value: Any, at: int) -> Any:
            with self.watched("broadcast_object", name), Blocked():
                return self.mpi.bcast(value, root=at)

        sig = Signature("broadcast_object", name, root=root)
        result = self.run_collective(sig, error, lambda: move(obj, root),
                                     lambda agreed_sig: move(None, agreed_sig.root))
        self.counters.record("broadcast_object", 0, _perf() - start)
        return result

    def allgather_object(self, obj: Any, *, name: str | None = None) -> list[Any]:
        """Return the list of every rank's picklable ``obj``, in rank order."""
        start = _perf()

        def move(value: Any) -> list[Any]:
            with self.watched("allgather_object", name), Blocked():
                return self.mpi.allgather(value)

        # Nothing to validate, but agreeing on the operation keeps a rank that calls another
        # collective here from pairing with this one (with check=True, every call).
        result = self.run_collective(Signature("allgather_object", name), None, lambda: move(obj), lambda _: move(None))
        self.counters.record("allgather_object", 0, _perf() - start)
        return result

    def barrier(self) -> None:
        """Block until every rank has reached this call."""
        start = _perf()
        if self.check is True:  # the exchange is itself a barrier, and pairs with ranks in resync or join
            self._agree(Signature("barrier"), None)
        else:
            self._move("barrier", None, self.transport.barrier)
        self.counters.record("barrier", 0, _perf() - start)

    # ----------------------------------------------------------------- groups
    def split(self, color: int, key: int = 0) -> Communicator:
        """Split into sub-communicators of the ranks passing the same ``color``."""
        return self.derive(self.mpi.Split(color, key))

    def new_group(self, ranks: list[int], *, check: bool | str | None = None) -> Communicator | None:
        """Return a communicator over ``ranks`` on its members and None elsewhere.

        Only the listed ranks need to call this (MPI_Comm_create_group).
        """
        ranks = [int(r) for r in ranks]
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"ranks={ranks} must be distinct ranks in [0, {self.size}); bad: {bad}")
        if self.rank not in ranks:
            return None
        group = self.mpi.Get_group().Incl(ranks)
        try:
            return self.derive(self.mpi.Create_group(group), check=check)
        finally:
            group.Free()

    def duplicate(self, *, check: bool | str | None = None) -> Communicator:
        """Return a communicator over the same ranks whose collectives never match this one's (collective)."""
        return self.derive(self.mpi.Dup(), check=check)

    def node(self) -> Communicator:
        """Return the communicator of the ranks that share this node's memory."""
        if self._node is None:
            self._node = self.derive(self.mpi.Split_type(self._MPI.COMM_TYPE_SHARED, key=self.rank))
        return self._node

    def derive(self, mpi_comm: Any, check: bool | str | None = None) -> Communicator:
        """Return a communicator over ``mpi_comm``, a communicator made from this one's (collective over its members).

        It shares this one's counters, timeline and watchdog, and its data moves over a transport
        of the same kind (for the torch transport, a new process group over its ranks).
        """
        ranks = [int(r) for r in self._MPI.Group.Translate_ranks(mpi_comm.Get_group(),
                                                                 list(range(mpi_comm.Get_size())),
                                                                 self.mpi.Get_group())]
        # Named after its members and how many communicators over them this one made: a derivation is
        # collective over its members, so they name it alike whatever else each of them derived.
        label = _ranks_label(ranks)
        count = self._derived[label] = self._derived.get(label, 0) + 1
        uid = f"{self.uid}/{label}.{count}"
        return Communicator(
            mpi_comm, transport=self.transport.derive(mpi_comm, ranks, uid), counters=self.counters,
            check=self.check if check is None else check, timeline=self.timeline, cuda_aware=self.cuda_aware,
            watchdog=self.watchdog, uid=uid,
        )

    def free(self) -> None:
        """Release this communicator's MPI communicator and transport (call on every member, once)."""
        self.transport.free()
        if self.mpi not in (self._MPI.COMM_WORLD, self._MPI.COMM_SELF, self._MPI.COMM_NULL):
            self.mpi.Free()

    def _reduction_of(self, sig: Signature) -> tuple[int, np.dtype, Any, str]:
        """Return (elements, dtype on the wire, transport op, op) of an agreed reduction signature."""
        wdt, rop, _ = wire_of(dtype_of_name(sig.dtype), sig.op, sig.device == "cuda", self.transport)
        return int(np.prod(sig.shape, dtype=np.int64)), wdt, rop, sig.op

    def _agreed_entry(self, sig: Signature) -> Agreed:
        """Return what later calls need of an agreed signature (the fused-flag plan for small all-reduces)."""
        entry = Agreed(sig)
        if sig.operation != "allreduce" or sig.op not in JOINABLE:
            return entry
        n, wdt, rop, op = self._reduction_of(sig)
        if sig.device != "cuda" and wdt == dtype_of_name(sig.dtype):  # the numpy fast path reduces in the input's dtype
            entry.shape, entry.dtype, entry.op, entry.plain = tuple(sig.shape), wdt, op, (rop, op == "avg")
        # A sum of 0/1 flags in one byte would wrap at 256 ranks.
        if n * wdt.itemsize > FUSED_BYTES or (wdt.itemsize == 1 and op in ("sum", "avg") and self.size > 100):
            return entry
        valid, deviating = flag_values(op)
        entry.fused = (n, wdt, rop, valid, deviating, op == "avg")
        return entry

    def _check_root(self, root: Any) -> None:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"root={root!r} is not a rank of this communicator; use 0..{self.size - 1}")


def live_communicators(counters: Counters) -> list[Communicator]:
    """Return the communicators alive in this process that record into ``counters``."""
    return [c for c in list(_live) if c.counters is counters]


class _Watched:
    """Register a blocking wait of ``comm`` with its watchdog (no-op without one).

    It may span a collective's steps (the caller computes between them), so the
    time it spans is not counted as blocked: the waits inside are (``Blocked``).
    """

    __slots__ = ("comm", "opname", "name", "token")

    def __init__(self, comm: Communicator, opname: str, name: str | None) -> None:
        self.comm, self.opname, self.name, self.token = comm, opname, name, None

    def __enter__(self) -> None:
        wd = self.comm.watchdog
        if wd is not None:
            self.comm._seq += 1
            self.token = wd.enter(self.comm.uid, self.comm._seq, self.opname, self.name)

    def __exit__(self, *exc: Any) -> None:
        if self.token is not None:
            self.comm.watchdog.leave(self.token)


def _in_order(comm: Communicator, order: Any, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``method`` on a lane in order with the submitting thread's CUDA stream (``StreamOrder``)."""
    with order.worker():
        return method(comm, *args, **kwargs)

