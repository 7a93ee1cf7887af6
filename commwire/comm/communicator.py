"""Collectives over an mpi4py communicator for numpy, torch and cupy arrays.

Every collective has one implementation that prepares the buffers and a
finishing step; the blocking and non-blocking variants only differ in the MPI
primitive passed in (``Allreduce`` vs ``Iallreduce``) and in when the finishing
step runs (at once, or when the handle completes).

Moves that need no arithmetic (broadcast, allgather, alltoall) travel as raw
bytes, so every dtype works. Reductions of float16/bfloat16 run in float32,
because MPI has no 16-bit floating-point sum, and are rounded back once.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from . import arrays
from .arrays import HALF_DTYPES, adapter_for, check_dtype
from .check import verify
from .handle import Handle
from .stats import Counters
from .timeline import Timeline

__all__ = ["Communicator", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "avg", "min", "max")
_ALIASES = {"average": "avg", "mean": "avg", "add": "sum"}
_FLOAT32 = np.dtype(np.float32)
_MAX_FIRST_CHECKS = 4096  # distinct (operation, name) pairs checked in "first" mode; names made per step stop there
_perf = time.perf_counter


class Communicator:
    """Run collectives on a group of MPI ranks.

    Args:
        mpi_comm: the mpi4py communicator to use (e.g. ``MPI.COMM_WORLD``).
        counters: where to record operation counts, bytes and times.
        check: verify that ranks agree on a collective's arguments: True before
            every call, "first" (default) on the first call of each (operation,
            name) — the first 4096 distinct pairs, so names made per step cost
            nothing after that — False never.
        timeline: optional Chrome-trace recorder.
        cuda_aware: hand CUDA buffers straight to MPI instead of staging them.

    Example:
        >>> comm = commwire.world()
        >>> comm.allreduce(np.ones(3), op="avg")
    """

    def __init__(
        self,
        mpi_comm: Any,
        *,
        counters: Counters | None = None,
        check: bool | str = "first",
        timeline: Timeline | None = None,
        cuda_aware: bool = False,
        watchdog: Any = None,
        uid: str = "world",
    ) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.mpi = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self.counters = counters if counters is not None else Counters()
        if check not in (False, True, "first"):
            raise ValueError(f"check={check!r} is not valid; use False, 'first' or True")
        self.check: bool | str = check
        self._seen: set[tuple[Any, ...]] = set()
        self._seen_allreduce: set[str | None] = set()
        self.timeline = timeline
        self.cuda_aware = cuda_aware
        self._mpi_ops = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}
        self._node: Communicator | None = None
        # (op, dtype) -> (MPI op, average?) for the fast allreduce path
        self._fast_ops = {
            (op, np.dtype(dt)): self._reduce_op(op, np.dtype(dt))
            for op in (*REDUCE_OPS, *_ALIASES)
            for dt in (np.float32, np.float64, np.int32, np.int64, np.uint8)
            if not (_ALIASES.get(op, op) == "avg" and np.dtype(dt).kind in "iu")
        }
        self.watchdog = watchdog
        self.uid = uid  # the same on every member: names this communicator in stall reports
        self._seq = 0
        self._derived = 0

    def __repr__(self) -> str:
        return f"<commwire.Communicator rank {self.rank} of {self.size}>"

    # ----------------------------------------------------------------- helpers
    def _reduce_op(self, op: str, dtype: np.dtype) -> tuple[Any, bool]:
        key = _ALIASES.get(op, op) if isinstance(op, str) else op
        mop = self._mpi_ops.get(key)
        if mop is None:
            raise ValueError(f"op={op!r} is not supported; use one of {', '.join(REDUCE_OPS)}")
        average = key == "avg"
        if average and dtype.kind in "iu":
            raise TypeError(
                f"op='avg' on {dtype} would truncate; use op='sum' and divide, or cast to a float dtype"
            )
        if key in ("min", "max") and (dtype.kind == "f" or dtype in HALF_DTYPES):
            mop = _nan_ops()[key]
        return mop, average

    def _launch(
        self,
        opname: str,
        name: str | None,
        nbytes: int,
        call: Callable[..., Any],
        args: tuple[Any, ...],
        finish: Callable[[], Any],
        nonblocking: bool,
    ) -> Any:
        start = _perf()
        counters, timeline, watchdog = self.counters, self.timeline, self.watchdog

        def complete() -> Any:
            result = finish()
            end = _perf()
            counters.record(opname, nbytes, end - start)
            if timeline is not None:
                timeline.add(name or opname, start, end, op=opname, bytes=nbytes)
            return result

        if watchdog is None:
            if nonblocking:
                return Handle([call(*args)], complete, name)
            call(*args)
            return complete()
        self._seq += 1
        if nonblocking:
            return Handle([call(*args)], complete, name, (watchdog, self.uid, self._seq, opname))
        token = watchdog.enter(self.uid, self._seq, opname, name)
        try:
            call(*args)
        finally:
            watchdog.leave(token)
        return complete()

    def watched(self, opname: str, name: str | None = None) -> Any:
        """Return a context manager that registers a blocking wait with the stall watchdog."""
        return _Watched(self, opname, name)

    def _verify(self, *signature: Any) -> None:
        # check=True: every call; check="first" (the default): the first call of each
        # (operation, name), which every rank of a correct program reaches together.
        if self.check is True or (self.check == "first" and signature[:2] not in self._seen
                                  and len(self._seen) < _MAX_FIRST_CHECKS):
            if self.check == "first":
                self._seen.add(signature[:2])
                if signature[0] == "allreduce":
                    self._seen_allreduce.add(signature[1])  # lets allreduce's fast path skip the tuple
            with self.watched("check " + str(signature[0]), signature[1]):
                verify(self.mpi, signature)

    def _device_direct(self, x: Any) -> bool:
        return self.cuda_aware and arrays.is_device_array(x)

    # ------------------------------------------------------------- allreduce
    def allreduce(self, x: Any, op: str = "sum", *, out: Any = None, name: str | None = None) -> Any:
        """Reduce ``x`` over all ranks and return the result on every rank.

        Args:
            x: numpy array, torch tensor or cupy array (any supported dtype).
            op: ``"sum"``, ``"avg"``, ``"min"`` or ``"max"``.
            out: optional array to write the result into; ``out=x`` reduces in place.
            name: label for the timeline, statistics and consistency checks.

        Returns:
            The reduced array, of the same kind, dtype, shape and device as ``x``.
        """
        # Fast path for the latency-bound common case (contiguous numpy array of
        # an MPI-native dtype, no checking or timeline): the general path below
        # costs a few microseconds of Python, as much as a small MPI_Allreduce.
        if (type(x) is np.ndarray and self.timeline is None and x.flags.c_contiguous
                and (not self.check or (self.check == "first" and name in self._seen_allreduce))):
            entry = self._fast_ops.get((op, x.dtype))
            if entry is not None:
                if out is None:
                    recv, sendbuf = np.empty_like(x), x
                elif out is x:
                    recv, sendbuf = x, self._MPI.IN_PLACE
                elif (type(out) is np.ndarray and out.dtype == x.dtype and out.shape == x.shape
                        and out.flags.c_contiguous and not np.may_share_memory(out, x)):
                    recv, sendbuf = out, x
                else:
                    return self._allreduce(x, op, out, name, False)
                start = _perf()
                watchdog = self.watchdog
                if watchdog is None:
                    self.mpi.Allreduce(sendbuf, recv, entry[0])
                else:
                    self._seq += 1
                    token = watchdog.enter(self.uid, self._seq, "allreduce", name)
                    try:
                        self.mpi.Allreduce(sendbuf, recv, entry[0])
                    finally:
                        watchdog.leave(token)
                if entry[1]:
                    np.divide(recv, self.size, out=recv)
                self.counters.record("allreduce", x.nbytes, _perf() - start)
                return recv
        return self._allreduce(x, op, out, name, False)

    def allreduce_async(self, x: Any, op: str = "sum", *, out: Any = None, name: str | None = None) -> Handle:
        """Start an all-reduce and return a handle whose ``wait()`` gives the result."""
        return self._allreduce(x, op, out, name, True)

    def _allreduce(self, x: Any, op: str, out: Any, name: str | None, nonblocking: bool) -> Any:
        if self._device_direct(x):
            return self._allreduce_device(x, op, out, name, nonblocking)
        adapter = adapter_for(x)
        send = adapter.host(x)
        dtype = send.dtype
        check_dtype(dtype)
        mop, average = self._reduce_op(op, dtype)
        if self.check:  # cheap test first: _verify decides between first-call and full checks
            self._verify("allreduce", name, send.shape, str(dtype), op)
        half = dtype in HALF_DTYPES
        work = send.astype(_FLOAT32) if half else send
        # Reduce straight into the caller's `out` when its memory can take the
        # result (same dtype and size, contiguous host memory): no extra copy.
        direct = None if out is None or half else adapter_for(out).out_view(out)
        if direct is not None and direct.dtype == dtype and direct.size == send.size:
            recv = direct.reshape(send.shape)
            if out is x or (direct is send):
                sendbuf = self._MPI.IN_PLACE
            elif np.may_share_memory(recv, send):  # partial overlap: MPI forbids it, use a temporary
                direct, recv, sendbuf = None, np.empty_like(work), work
            else:
                sendbuf = work
        else:
            direct = None
            recv, sendbuf = np.empty_like(work), work
        size = self.size

        def finish() -> Any:
            if average:
                np.divide(recv, size, out=recv)
            adapter.release(send)
            if direct is not None:
                return out
            result = recv.astype(dtype) if half else recv
            if out is not None:
                return adapter.write(out, result)
            return adapter.wrap(result, x)

        mpi_call = self.mpi.Iallreduce if nonblocking else self.mpi.Allreduce
        return self._launch("allreduce", name, send.nbytes, mpi_call, (sendbuf, recv, mop), finish, nonblocking)

    def _allreduce_device(self, x: Any, op: str, out: Any, name: str | None, nonblocking: bool) -> Any:
        # CUDA-aware MPI: hand the device buffer over directly. MPI does not know
        # about CUDA streams, so the producing stream is synchronised first.
        dev = _DeviceOps(x)
        dtype = dev.numpy_dtype(x)
        check_dtype(dtype)
        mop, average = self._reduce_op(op, dtype)
        if self.check:  # cheap test first: _verify decides between first-call and full checks
            self._verify("allreduce", name, tuple(x.shape), str(dtype), op)
        half = dtype in HALF_DTYPES
        send = dev.contiguous(dev.to_float32(x) if half else x)
        recv = dev.empty_like(send)
        dev.synchronize(send)
        size = self.size

        def finish() -> Any:
            result = recv / size if average else recv
            if half:
                result = dev.cast_like(result, x)
            if out is not None:
                dev.copy_into(out, result)
                return out
            return result

        mpi_call = self.mpi.Iallreduce if nonblocking else self.mpi.Allreduce
        nbytes = int(send.nbytes)
        return self._launch("allreduce", name, nbytes, mpi_call, (send, recv, mop), finish, nonblocking)

    # ------------------------------------------------------------- allgather
    def allgather(self, x: Any, *, name: str | None = None) -> Any:
        """Concatenate every rank's ``x`` along the first dimension (sizes may differ)."""
        return self._allgather(x, name, False)

    def allgather_async(self, x: Any, *, name: str | None = None) -> Handle:
        """Start an all-gather; the handle's ``wait()`` returns the concatenation."""
        return self._allgather(x, name, True)

    def _allgather(self, x: Any, name: str | None, nonblocking: bool) -> Any:
        adapter = adapter_for(x)
        send = adapter.host(x)
        check_dtype(send.dtype)
        if send.ndim == 0:
            send = send.reshape(1)
        if self.check:  # cheap test first: _verify decides between first-call and full checks
            self._verify("allgather", name, send.shape[1:], str(send.dtype))
        with self.watched("allgather sizes", name):
            rows = _exchange_rows(self, send)
        recv = np.empty((int(rows.sum()),) + send.shape[1:], dtype=send.dtype)
        row_bytes = send.itemsize * int(np.prod(send.shape[1:], dtype=np.int64))
        counts = rows * row_bytes
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        sendbuf = send.reshape(-1).view(np.uint8)
        recvspec = [recv.reshape(-1).view(np.uint8), (counts, displs), self._MPI.BYTE]

        def finish() -> Any:
            adapter.release(send)
            return adapter.wrap(recv, x)

        mpi_call = self.mpi.Iallgatherv if nonblocking else self.mpi.Allgatherv
        return self._launch("allgather", name, send.nbytes, mpi_call, (sendbuf, recvspec), finish, nonblocking)

    # ------------------------------------------------------------- broadcast
    def broadcast(self, x: Any, root: int = 0, *, out: Any = None, name: str | None = None) -> Any:
        """Return root's ``x`` on every rank (every rank passes an array of that shape)."""
        return self._broadcast(x, root, out, name, False)

    def broadcast_async(self, x: Any, root: int = 0, *, out: Any = None, name: str | None = None) -> Handle:
        """Start a broadcast from ``root``; the handle's ``wait()`` returns the array."""
        return self._broadcast(x, root, out, name, True)

    def _broadcast(self, x: Any, root: int, out: Any, name: str | None, nonblocking: bool) -> Any:
        self._check_root(root)
        adapter = adapter_for(x)
        send = adapter.host(x)
        check_dtype(send.dtype)
        if self.check:  # cheap test first: _verify decides between first-call and full checks
            self._verify("broadcast", name, send.shape, str(send.dtype), None, root)
        if out is x and adapter.kind == "numpy":
            buf = send
        elif self.rank == root:
            buf = send.copy()
        else:
            buf = np.empty_like(send)

        def finish() -> Any:
            adapter.release(send)
            if out is not None:
                return adapter.write(out, buf)
            return adapter.wrap(buf, x)

        mpi_call = self.mpi.Ibcast if nonblocking else self.mpi.Bcast
        args = (buf.reshape(-1).view(np.uint8), root)
        return self._launch("broadcast", name, send.nbytes, mpi_call, args, finish, nonblocking)

    # -------------------------------------------------------- reduce_scatter
    def reduce_scatter(self, x: Any, op: str = "sum", *, name: str | None = None) -> Any:
        """Reduce ``x`` over ranks and return this rank's block of rows.

        Rows are split as ``numpy.array_split`` does: the first ``len(x) % size``
        ranks get one row more.
        """
        return self._reduce_scatter(x, op, name, False)

    def reduce_scatter_async(self, x: Any, op: str = "sum", *, name: str | None = None) -> Handle:
        """Start a reduce-scatter; the handle's ``wait()`` returns this rank's block."""
        return self._reduce_scatter(x, op, name, True)

    def _reduce_scatter(self, x: Any, op: str, name: str | None, nonblocking: bool) -> Any:
        adapter = adapter_for(x)
        send = adapter.host(x)
        dtype = send.dtype
        check_dtype(dtype)
        mop, average = self._reduce_op(op, dtype)
        if send.ndim == 0:
            raise ValueError("reduce_scatter needs an array with at least one dimension, got a scalar")
        if self.check:  # cheap test first: _verify decides between first-call and full checks
            self._verify("reduce_scatter", name, send.shape, str(dtype), op)
        half = dtype in HALF_DTYPES
        work = send.astype(_FLOAT32) if half else send
        rows = split_rows(send.shape[0], self.size)
        row_elems = int(np.prod(send.shape[1:], dtype=np.int64))
        recv = np.empty((int(rows[self.rank]),) + send.shape[1:], dtype=work.dtype)
        size = self.size

        def finish() -> Any:
            if average:
                np.divide(recv, size, out=recv)
            adapter.release(send)
            return adapter.wrap(recv.astype(dtype) if half else recv, x)

        mpi_call = self.mpi.Ireduce_scatter if nonblocking else self.mpi.Reduce_scatter
        args = (work, recv, rows * row_elems, mop)
        return self._launch("reduce_scatter", name, send.nbytes, mpi_call, args, finish, nonblocking)

    # --------------------------------------------------------------- alltoall
    def alltoall(self, x: Any, *, name: str | None = None) -> Any:
        """Send block i of ``x``'s rows to rank i; return the blocks received, in rank order."""
        return self._alltoall(x, name, False)

    def alltoall_async(self, x: Any, *, name: str | None = None) -> Handle:
        """Start an all-to-all; the handle's ``wait()`` returns the received blocks."""
        return self._alltoall(x, name, True)

    def _alltoall(self, x: Any, name: str | None, nonblocking: bool) -> Any:
        adapter = adapter_for(x)
        send = adapter.host(x)
        check_dtype(send.dtype)
        if send.ndim == 0 or send.shape[0] % self.size:
            raise ValueError(
                f"alltoall needs a first dimension divisible by the {self.size} ranks, got shape {send.shape}; "
                "pad the array"
            )
        if self.check:  # cheap test first: _verify decides between first-call and full checks
            self._verify("alltoall", name, send.shape, str(send.dtype))
        recv = np.empty_like(send)

        def finish() -> Any:
            adapter.release(send)
            return adapter.wrap(recv, x)

        mpi_call = self.mpi.Ialltoall if nonblocking else self.mpi.Alltoall
        args = (send.reshape(-1).view(np.uint8), recv.reshape(-1).view(np.uint8))
        return self._launch("alltoall", name, send.nbytes, mpi_call, args, finish, nonblocking)

    # ---------------------------------------------------------------- objects
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return root's picklable ``obj`` on every rank."""
        self._check_root(root)
        start = _perf()
        with self.watched("broadcast_object"):
            result = self.mpi.bcast(obj, root=root)
        self.counters.record("broadcast_object", 0, _perf() - start)
        return result

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's picklable ``obj``, in rank order."""
        start = _perf()
        with self.watched("allgather_object"):
            result = self.mpi.allgather(obj)
        self.counters.record("allgather_object", 0, _perf() - start)
        return result

    def barrier(self) -> None:
        """Block until every rank has reached this call."""
        start = _perf()
        with self.watched("barrier"):
            self.mpi.Barrier()
        self.counters.record("barrier", 0, _perf() - start)

    # ----------------------------------------------------------------- groups
    def split(self, color: int, key: int = 0) -> Communicator:
        """Split into sub-communicators of the ranks passing the same ``color``."""
        return self._derive(self.mpi.Split(color, key))

    def new_group(self, ranks: list[int]) -> Communicator | None:
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
            return self._derive(self.mpi.Create_group(group))
        finally:
            group.Free()

    def node(self) -> Communicator:
        """Return the communicator of the ranks that share this node's memory."""
        if self._node is None:
            self._node = self._derive(self.mpi.Split_type(self._MPI.COMM_TYPE_SHARED, key=self.rank))
        return self._node

    def _derive(self, mpi_comm: Any) -> Communicator:
        # Derivations are collective, so every member numbers them alike.
        self._derived += 1
        return Communicator(
            mpi_comm, counters=self.counters, check=self.check, timeline=self.timeline, cuda_aware=self.cuda_aware,
            watchdog=self.watchdog, uid=f"{self.uid}/{self._derived}",
        )

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root={root} is not a rank of this communicator; use 0..{self.size - 1}")


class _Watched:
    """Register a blocking wait of ``comm`` with its watchdog (no-op without one)."""

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


_NAN_OPS: dict[str, Any] = {}


def _nan_ops() -> dict[str, Any]:
    """Return MPI min/max ops for floats that propagate NaN, as numpy's do.

    MPI's built-in MIN/MAX compare with ``<``, so a NaN wins or loses depending
    on the reduction order — different ranks can then end with different
    results. These user-defined ops (numpy.minimum/maximum) make a NaN anywhere
    the result everywhere.
    """
    if not _NAN_OPS:
        from mpi4py import MPI

        def make(fn: Any) -> Any:
            def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
                dtype = np.float32 if datatype.Get_size() == 4 else np.float64
                a = np.frombuffer(inbuf, dtype=dtype)
                b = np.frombuffer(inoutbuf, dtype=dtype)
                fn(a, b, out=b)

            return MPI.Op.Create(reduce, commute=True)

        _NAN_OPS.update(min=make(np.minimum), max=make(np.maximum))
    return _NAN_OPS


def split_rows(n: int, parts: int) -> np.ndarray:
    """Return how many of ``n`` rows each of ``parts`` ranks gets (array_split rule)."""
    base, extra = divmod(n, parts)
    return np.array([base + (i < extra) for i in range(parts)], dtype=np.int64)


def _exchange_rows(comm: Communicator, send: np.ndarray) -> np.ndarray:
    # Every rank learns every rank's row count, row size and dtype in one small
    # Allgather, so a mismatch raises the same error on all ranks instead of
    # truncating or hanging inside Allgatherv.
    mine = np.array([send.shape[0], send.size // max(send.shape[0], 1) if send.shape[0] else -1,
                     send.dtype.num, send.itemsize], dtype=np.int64)
    everyone = np.empty((comm.size, 4), dtype=np.int64)
    comm.mpi.Allgather(mine, everyone)
    row_sizes = {int(r) for r in everyone[:, 1] if r >= 0}
    kinds = {(int(a), int(b)) for a, b in everyone[:, 2:]}
    if len(row_sizes) > 1 or len(kinds) > 1:
        per_rank = ", ".join(
            f"rank {r}: row size {int(everyone[r, 1])}, itemsize {int(everyone[r, 3])}" for r in range(comm.size)
        )
        raise ValueError(f"allgather needs the same trailing shape and dtype on every rank; got {per_rank}")
    return everyone[:, 0].copy()


class _DeviceOps:
    """The few device-array operations the CUDA-aware path needs (torch or cupy)."""

    def __init__(self, x: Any) -> None:
        self.is_torch = type(x).__module__.startswith("torch")
        if self.is_torch:
            import torch

            self.lib = torch
        else:
            import cupy

            self.lib = cupy

    def numpy_dtype(self, x: Any) -> np.dtype:
        if self.is_torch:
            if x.dtype == self.lib.bfloat16:
                return arrays.BFLOAT16
            return np.dtype(str(x.dtype).replace("torch.", ""))
        return np.dtype(x.dtype)

    def to_float32(self, x: Any) -> Any:
        return x.float() if self.is_torch else x.astype(self.lib.float32)

    def contiguous(self, x: Any) -> Any:
        return x.contiguous() if self.is_torch else self.lib.ascontiguousarray(x)

    def empty_like(self, x: Any) -> Any:
        return self.lib.empty_like(x)

    def cast_like(self, result: Any, like: Any) -> Any:
        return result.to(like.dtype) if self.is_torch else result.astype(like.dtype)

    def synchronize(self, x: Any) -> None:
        if self.is_torch:
            self.lib.cuda.current_stream(x.device).synchronize()
        else:
            self.lib.cuda.get_current_stream().synchronize()

    def copy_into(self, out: Any, result: Any) -> None:
        if self.is_torch:
            out.copy_(result.reshape(out.shape))
        else:
            out[...] = result.reshape(out.shape)
