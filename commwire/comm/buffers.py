"""The buffers of one collective call on this rank, and the checks of its arguments.

A ``Reduction`` holds what an all-reduce or reduce-scatter sends and receives:
the work buffer (on the device for device arrays, float32 for the half types,
order-preserving integers for float min/max of device arrays), the dtype on the
wire, and where the result lands (``out=``). The helpers beside it give the
other collectives their send and receive buffers, the fast path of a numpy or
CPU-tensor all-reduce its landing buffer, and every collective the argument
checks and descriptions that go into its signature (commwire.comm.protocol).
Nothing here communicates: commwire.comm.communicator runs the collectives.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import arrays
from .arrays import HALF_DTYPES, DeviceOps, adapter_for, check_dtype, device_ops, dtype_name
from .protocol import Signature
from .reduce import check_reduction, normalize_op, work_dtype
from .transport import Transport

__all__ = ["Reduction", "wire_of", "send_buffer", "cpu_tensor_view", "tensor_of", "same_view", "landing",
           "plain_out", "dtype_of_name", "nbytes_of", "describe", "device_of", "op_label", "check_out", "row_counts",
           "splits_of", "split_rows", "empty", "as_bytes", "ready_bytes"]


class Reduction:
    """The prepared buffers of one reduction (all-reduce or reduce-scatter) on this rank.

    Building it validates everything a rank can check alone: array kind,
    dtype, operation, ``out``. Device arrays (but for Adasum, which runs on
    host copies) get their work buffer on the device: a contiguous copy or x
    itself, float32 for the half types, order-preserving integers for float
    min/max (see ``wire_of``); MPI then reads it there (``direct``) or a host
    copy of it.
    """

    __slots__ = ("size", "x", "out", "adapter", "op", "dtype", "work", "send", "mop", "average", "dev", "direct",
                 "fresh", "ordered", "wire", "shape", "nbytes")

    def __init__(self, x: Any, op: str, out: Any, transport: Transport, size: int) -> None:
        self.size, self.x, self.out = size, x, out
        self.op = normalize_op(op)
        on_device = arrays.is_device_array(x)
        self.dev: DeviceOps | None = device_ops(x) if on_device and self.op != "adasum" else None
        self.direct = self.dev is not None and transport.device_buffers(x)
        if self.op != "adasum":  # Adasum runs on host copies over MPI
            transport.check_buffer(x, on_device)
        if self.dev is not None:
            self.dtype = self.dev.numpy_dtype(x)
        else:
            self.adapter = adapter_for(x)
            self.send = self.adapter.host(x)
            self.dtype = self.send.dtype
        check_dtype(self.dtype)
        check_reduction(self.op, self.dtype)
        check_out(x, out, "allreduce")
        self.wire, self.mop, self.ordered = wire_of(self.dtype, self.op, on_device, transport)
        self.average = self.op == "avg"
        self.shape = tuple(x.shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        half = self.dtype in HALF_DTYPES
        if self.dev is not None:
            dev = self.dev
            work = dev.float32(x) if half else dev.contiguous(x)
            if self.ordered:
                work = dev.ordered(work, self.op)
            self.work = work
            self.fresh = half or self.ordered or not dev.is_contiguous(x)  # work is a copy of ours
        else:
            self.work = self.send.astype(work_dtype(self.dtype)) if half else self.send
            self.fresh = half

    def sig(self, name: str | None, operation: str = "allreduce") -> Signature:
        """Return the signature every rank must agree on."""
        return Signature(operation, name, self.shape, dtype_name(self.dtype), self.op, device=device_of(self.x))

    # MPI's buffers: the device work itself when direct, else host memory.
    def mpi_send(self) -> Any:
        """Return the buffer MPI reads this rank's contribution from (see ``release``)."""
        if self.dev is None:
            return self.work
        if self.direct:
            self.dev.synchronize(self.work)  # MPI knows no CUDA streams: queued work must be done
            return self.work
        return self.dev.to_host(self.work)

    def mpi_empty(self, shape: tuple[int, ...]) -> Any:
        """Return an uninitialised receive buffer of the wire dtype where MPI writes (device when direct)."""
        if self.dev is not None and self.direct:
            return self.dev.empty(shape, self.wire, self.work)
        return np.empty(shape, dtype=self.wire)

    def release(self, send: Any) -> None:
        """Return a host staging buffer of ``mpi_send`` to its pool."""
        if self.dev is not None and not self.direct:
            self.dev.release(send)

    def buffers(self) -> tuple[Any, Any]:
        """Return (receive buffer, send buffer or MPI.IN_PLACE) for MPI_Allreduce."""
        if self.dev is not None:
            if not self.direct or self.fresh or self.out is self.x:
                # A buffer of ours (host copy, or device copy) or x's own memory for out=x: in place.
                return self.mpi_send(), None
            return self.mpi_empty(tuple(self.work.shape)), self.mpi_send()
        out, x, send = self.out, self.x, self.send
        # Reduce straight into the caller's `out` when its memory can take the
        # result (same dtype and size, contiguous host memory): no extra copy.
        direct = None if out is None or self.work is not send else self.adapter.out_view(out)
        if direct is not None and direct.dtype == self.dtype and direct.size == send.size:
            recv = direct.reshape(send.shape)
            if out is x or direct is send:
                return recv, None
            if not np.may_share_memory(recv, send):
                return recv, send
        return np.empty_like(self.work), self.work

    def fused_buffer(self, n: int, flag: Any) -> Any:
        """Return this rank's work and the deviation flag in one buffer of n + 1 wire elements for MPI."""
        if self.dev is not None and self.direct:
            buf = self.dev.empty((n + 1,), self.wire, self.work)
            self.dev.flat_copy(buf[:n], self.work)
            self.dev.set_item(buf, n, flag)
            self.dev.synchronize(buf)
            return buf
        buf = np.empty(n + 1, dtype=self.wire)
        host = self.work if self.dev is None else self.dev.to_host(self.work)
        buf[:n] = host.reshape(-1)
        if self.dev is not None:
            self.dev.release(host)
        buf[n] = flag
        return buf

    def flag(self, buf: Any, n: int) -> Any:
        """Return the reduced flag of a ``fused_buffer``."""
        return self.dev.item(buf, n) if self.dev is not None and self.direct else buf.item(n)

    def finish(self, recv: Any) -> Any:
        """Turn the reduced buffer into the result: average, cast back, copy into ``out``."""
        size = self.size
        if self.dev is not None:
            return self._finish_device(recv, size)
        if self.average:
            np.divide(recv, size, out=recv)
        self.adapter.release(self.send)
        out_view = None if self.out is None else self.adapter.out_view(self.out)
        if out_view is not None and np.may_share_memory(out_view, recv) and recv.dtype == self.dtype:
            return self.out
        result = recv.astype(self.dtype) if recv.dtype != self.dtype else recv
        if self.out is not None:
            return self.adapter.write(self.out, result)
        return self.adapter.wrap(result, self.x)

    def _finish_device(self, recv: Any, size: int) -> Any:
        dev = self.dev
        assert dev is not None
        in_x = self.direct and recv is self.work and not self.fresh  # reduced in place in x's memory
        result = recv if self.direct else dev.from_host(recv, self.work)
        if self.ordered:
            result = dev.unordered(result, work_dtype(self.dtype))
        if self.average:
            result = dev.divide_(result, size)
        if self.dtype in HALF_DTYPES:
            result = dev.cast(result, self.dtype)
        if self.out is None:
            return result
        if not (in_x and self.out is self.x):
            dev.copy_into(self.out, result)
        return self.out


_ORDERED = {np.dtype(np.float32): np.dtype(np.int32), np.dtype(np.float64): np.dtype(np.int64)}


def wire_of(dtype: np.dtype, op: str, device: bool, transport: Transport) -> tuple[np.dtype, Any, bool]:
    """Return (dtype on the wire, transport op, whether as ordered integers) of reducing ``dtype`` with ``op``.

    Device arrays reduce float min/max as order-preserving integers with the
    transport's own MIN/MAX (``DeviceOps.ordered``), on every path: which
    messages travel depends on the agreed signature (its device field) only.
    """
    wdt = work_dtype(dtype)
    if op == "adasum":
        return wdt, None, False
    if device and op in ("min", "max") and wdt in _ORDERED:
        return _ORDERED[wdt], transport.reduce_op(op, _ORDERED[wdt]), True
    return wdt, transport.reduce_op(op, dtype), False



def send_buffer(transport: Transport, x: Any) -> tuple[DeviceOps | None, Any, np.dtype, Any]:
    """Return (device ops or None, the buffer the transport sends, its numpy dtype, host adapter) of a data move.

    Device arrays go to the transport as themselves where it takes device buffers (a CUDA-aware
    MPI, an NCCL group); everything else as a host view (device arrays staged through host
    memory by their adapter).
    """
    on_device = arrays.is_device_array(x)
    transport.check_buffer(x, on_device)
    if on_device and transport.device_buffers(x):
        dev = device_ops(x)
        dtype = dev.numpy_dtype(x)
        check_dtype(dtype)
        return dev, dev.contiguous(x), dtype, None
    adapter = adapter_for(x)
    send = adapter.host(x)
    check_dtype(send.dtype)
    return None, send, send.dtype, adapter


def cpu_tensor_view(x: Any, out: Any) -> np.ndarray | None:
    """Return the numpy view of CPU torch tensor ``x`` where ``allreduce(x, out=out)`` may take the numpy
    fast path (``out`` None or ``x`` itself), else None. Never imports torch: without it no tensor exists."""
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor or (out is not None and out is not x):
        return None
    if x.device.type != "cpu" or x.requires_grad:
        return None
    try:
        return x.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), a conjugate or negative view
        return None


def tensor_of(result: np.ndarray) -> Any:
    """Return the fast path's new result array as a CPU tensor sharing its memory."""
    return sys.modules["torch"].from_numpy(result)


def same_view(out: np.ndarray, x: np.ndarray) -> bool:
    """Return whether ``out`` and ``x`` are writeable views of exactly the same elements (``t.numpy()`` twice)."""
    return (out.shape == x.shape and out.dtype == x.dtype and out.strides == x.strides and out.flags.writeable
            and x.flags.writeable and out.__array_interface__["data"][0] == x.__array_interface__["data"][0])


def landing(x: np.ndarray, out: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """Return (the buffer the fast path's all-reduce of ``x`` lands in, its send buffer or None for in place)."""
    if out is x:
        return x, None
    if out is None or plain_out(out, x):
        return (np.empty_like(x) if out is None else out), x
    return np.array(x), None  # an out the data cannot land in directly (strided, or overlapping x): a copy


def plain_out(out: Any, x: np.ndarray) -> bool:
    """Return whether ``out`` is a numpy array the fast path may write x's result into directly."""
    return (type(out) is np.ndarray and out.dtype == x.dtype and out.shape == x.shape and out.flags.c_contiguous
            and out.flags.writeable and not np.may_share_memory(out, x))


def dtype_of_name(name: str) -> np.dtype:
    """Return the numpy dtype of a signature's dtype name (``"bfloat16"`` included)."""
    return arrays.bfloat16() if name == "bfloat16" else np.dtype(name)


def nbytes_of(shape: tuple[int, ...], dtype: str) -> int:
    """Return the bytes of an array of ``shape`` and dtype name ``dtype``."""
    return int(np.prod(shape, dtype=np.int64)) * dtype_of_name(dtype).itemsize


def describe(x: Any) -> tuple[Any, Any]:
    """Return (shape, dtype name) of whatever ``x`` is, for error messages."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    return (tuple(shape) if shape is not None else type(x).__name__, dtype_name(dtype) if dtype is not None else None)


def device_of(x: Any) -> str:
    """Return ``"cuda"`` for a device array (or a stand-in for one), else ``"cpu"``: part of a call's signature."""
    return "cuda" if arrays.is_device_array(x) else "cpu"


def op_label(op: Any) -> Any:
    """Return the canonical name of a reduction ``op`` (``"sum"``, ``"avg"``, ...), or ``op`` itself if unknown."""
    try:
        return normalize_op(op)
    except ValueError:
        return op


def check_out(x: Any, out: Any, opname: str) -> None:
    """Raise ValueError unless ``out`` can hold the result of ``opname`` on ``x``."""
    if out is None or out is x:
        return
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"out= must be an array like x (numpy, torch or cupy), got {type(out).__name__}")
    if tuple(shape) != tuple(x.shape) or dtype_name(dtype) != dtype_name(x.dtype):
        raise ValueError(f"out= has shape {tuple(shape)} and dtype {dtype_name(dtype)}, but {opname} of x needs "
                         f"shape {tuple(x.shape)} and dtype {dtype_name(x.dtype)}; pass such an array or out=None")


def row_counts(counts: Any, rows: int, size: int) -> np.ndarray:
    """Return each rank's rows of a reduce-scatter (array_split's rule when ``counts`` is None)."""
    if counts is None:
        return split_rows(rows, size)
    values = np.asarray(counts).reshape(-1)
    if values.dtype.kind not in "iu" or values.size != size or (values < 0).any() or int(values.sum()) != rows:
        raise ValueError(f"counts={values.tolist()} must give a non-negative number of rows for each of the "
                         f"{size} ranks, summing to the first dimension ({rows})")
    return values.astype(np.int64)


def splits_of(send: np.ndarray, splits: Any, size: int) -> np.ndarray:
    """Return the rows to send to each rank, validated (equal blocks when ``splits`` is None)."""
    if send.ndim == 0:
        raise ValueError("alltoall needs an array with at least one dimension, got a scalar")
    rows = send.shape[0]
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall needs a first dimension divisible by the {size} ranks, got shape "
                             f"{tuple(send.shape)}; pad the array or pass splits=")
        return np.full(size, rows // size, dtype=np.int64)
    values = np.asarray(adapter_for(splits).host(splits) if not isinstance(splits, (list, tuple)) else splits)
    if values.dtype.kind not in "iu":
        raise ValueError(f"splits must hold integers (e.g. int32), got dtype {dtype_name(values.dtype)}")
    values = values.reshape(-1).astype(np.int64)
    if values.size != size or (values < 0).any():
        raise ValueError(f"splits must give a non-negative row count for each of the {size} ranks, "
                         f"got {values.tolist()}")
    if values.sum() > rows:
        raise ValueError(f"splits sum to {int(values.sum())} rows but the tensor has only {rows}; "
                         "make the splits add up to at most its first dimension")
    return values


def split_rows(n: int, parts: int) -> np.ndarray:
    """Return how many of ``n`` rows each of ``parts`` ranks gets (array_split rule)."""
    base, extra = divmod(n, parts)
    return np.array([base + (i < extra) for i in range(parts)], dtype=np.int64)


def empty(dev: DeviceOps | None, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
    """Return an uninitialised buffer on ``like``'s device (``dev``) or in host memory."""
    return np.empty(shape, dtype=dtype) if dev is None else dev.empty(shape, dtype, like)


def as_bytes(dev: DeviceOps | None, buf: Any) -> Any:
    """Return contiguous ``buf`` as a flat uint8 view (raw-byte moves)."""
    return buf.reshape(-1).view(np.uint8) if dev is None else dev.bytes(buf)


def ready_bytes(dev: DeviceOps | None, buf: Any) -> Any:
    """Return ``buf``'s bytes for MPI to read, after the work queued on it is done (device buffers)."""
    if dev is not None:
        dev.synchronize(buf)  # MPI knows no CUDA streams
    return as_bytes(dev, buf)
