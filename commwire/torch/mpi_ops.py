"""Horovod's tensor collectives over commwire's core: sync, async, in-place, grouped, differentiable.

Every function runs one core collective (commwire.comm.Communicator) of the
process set's communicator, on that communicator's background lane, in call
order — Horovod's background thread. ``*_async`` returns a handle for
``poll``/``synchronize``; the plain names wait for it; the ``*_`` names write
into their argument. Arguments a rank finds wrong are handed to the core
collective as ``Invalid`` markers, so every member of the process set raises
the same error together (commwire.comm.check).

Semantics follow Horovod: ``average=`` is the deprecated spelling of
``op=Average``/``Sum``; integer averages truncate toward zero; pre- and
post-scaling happen in float64 for integers and float32 for float16 on the
CPU; ``root_rank`` is a global rank; collectives of the ``grouped_*`` family
travel fused (one collective per dtype); gradients: allreduce → allreduce of
the gradient with the same op and scales, allgather → the averaged gradient's
own rows, broadcast → the averaged gradient on the root and zeros elsewhere,
alltoall → alltoall back, reducescatter → allgather (times the size for Sum).
"""

from __future__ import annotations

import operator
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..comm.arrays import Invalid
from ..comm.communicator import Communicator
from ..comm.handle import Handle
from ..comm.reduce import normalize_op
# horovod.torch.mpi_ops also holds the lifecycle, introspection and process-set names: code that
# imports them from there (from horovod.torch.mpi_ops import rank, size, Sum) switches by its import.
from .basics import (
    Adasum, Average, Max, Min, Product, Sum, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
    gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
    mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline,
)
from .process_sets import ProcessSet, add_process_set, comm_of, global_process_set, remove_process_set
from .compression import Compression, resolve

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "sparse_allreduce_async", "poll", "synchronize", "join", "barrier",
    # as horovod.torch.mpi_ops has them (defined in commwire.torch.basics and .process_sets)
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "gloo_built", "gloo_enabled", "init", "is_homogeneous", "is_initialized", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "rocm_built",
    "shutdown", "size", "start_timeline", "stop_timeline", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set",
]


# --------------------------------------------------------------------------- handles
class HorovodHandle:
    """A collective in flight: ``poll`` it, ``synchronize`` it for the result."""

    __slots__ = ("_inner", "_finish", "_key", "_done", "_result")

    def __init__(self, inner: Handle, finish: Callable[[Any], Any] | None, key: tuple[Any, ...] | None) -> None:
        self._inner, self._finish, self._key = inner, finish, key
        self._done, self._result = False, None

    def poll(self) -> bool:
        """Return whether the collective has completed."""
        return self._done or self._inner.test()

    def wait(self) -> Any:
        """Block until completion and return the result (re-raises the collective's error)."""
        if not self._done:
            try:
                value = self._inner.wait()
                self._result = self._finish(value) if self._finish is not None else value
            finally:
                self._done = True
                _forget(self)
        return self._result


_in_flight: dict[tuple[Any, ...], HorovodHandle] = {}
_in_flight_lock = threading.Lock()


def _forget(handle: HorovodHandle) -> None:
    with _in_flight_lock:
        if handle._key is not None and _in_flight.get(handle._key) is handle:
            del _in_flight[handle._key]


def _submit(process_set: Any, fn: Callable[..., Any], *args: Any, name: str | None = None,
            finish: Callable[[Any], Any] | None = None, **kwargs: Any) -> HorovodHandle:
    """Run ``fn(lane_comm, *args, name=name, **kwargs)`` on the process set's lane."""
    comm = comm_of(process_set)
    key = None
    if name is not None:
        key = (id(comm), name)
        with _in_flight_lock:
            other = _in_flight.get(key)
            if other is not None and not other.poll():
                raise ValueError(f"a collective named {name!r} is still in flight on this rank; names of "
                                 "concurrent collectives must be unique (synchronize it first or pick another name)")
    handle = HorovodHandle(comm.submit(fn, *args, name=name, **kwargs), finish, key)
    if key is not None:
        with _in_flight_lock:
            _in_flight[key] = handle
    return handle


def _call(process_set: Any, fn: Callable[..., Any], *args: Any, name: str | None = None, **kwargs: Any) -> Any:
    """Run ``fn(lane_comm, *args, name=name, **kwargs)`` in order with the lane's work; return its result."""
    comm = comm_of(process_set)
    if name is not None:
        with _in_flight_lock:
            other = _in_flight.get((id(comm), name))
        if other is not None and not other.poll():
            raise ValueError(f"a collective named {name!r} is still in flight on this rank; names of "
                             "concurrent collectives must be unique (synchronize it first or pick another name)")
    return comm.call(fn, *args, name=name, **kwargs)


def poll(handle: Any) -> bool:
    """Return whether the collective of ``handle`` has completed (never blocks)."""
    if isinstance(handle, HorovodHandle):
        return handle.poll()
    if isinstance(handle, Handle):
        return handle.test()
    raise TypeError(f"poll() takes a handle returned by an *_async function, got {type(handle).__name__}")


def synchronize(handle: Any) -> Any:
    """Wait for ``handle`` and return its result."""
    if isinstance(handle, (HorovodHandle, Handle)):
        return handle.wait()
    if callable(handle):  # sparse_allreduce_async returns a function, as Horovod's does
        return handle()
    raise TypeError(f"synchronize() takes a handle returned by an *_async function, got {type(handle).__name__}")


# --------------------------------------------------------------------------- arguments
def _resolve_op(average: Any, op: Any, default: str = Average) -> str:
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed", DeprecationWarning,
                      stacklevel=3)
        return Average if average else Sum
    return default if op is None else normalize_op(op)


def _rooted(data: Any, root_rank: Any, process_set: Any) -> tuple[Any, int]:
    """Return (data, root as the process set's rank); data becomes Invalid if ``root_rank`` is no member."""
    ranks = (global_process_set if process_set is None else process_set).ranks
    if isinstance(root_rank, (int, np.integer)) and not isinstance(root_rank, bool) and int(root_rank) in ranks:
        return data, ranks.index(int(root_rank))
    error = ValueError(f"root_rank={root_rank!r} is not a rank of the process set (its ranks: {ranks}); pass the "
                       "global rank of one of its members")
    return Invalid(error, getattr(data, "shape", None), getattr(data, "dtype", None)), 0


def _scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply by ``factor`` as Horovod does: in float64 for integers, float32 for CPU float16."""
    if factor == 1.0:
        return t
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        return (t.double() * factor).to(t.dtype)
    if t.dtype in (torch.float16, torch.bfloat16) and not t.is_cuda:
        return (t.float() * factor).to(t.dtype)
    return t * factor


def _int_average(t: torch.Tensor, op: str) -> bool:
    return op == Average and not (t.dtype.is_floating_point or t.dtype.is_complex)


def _core_reduce(comm: Communicator, x: Any, op: str, name: str | None, codec: Any, out: Any = None) -> Any:
    if codec is not None and not isinstance(x, Invalid):
        from ..codecs.collective import compressed_allreduce

        return compressed_allreduce(comm, x, op, codec=codec, out=out, name=name)
    return comm.allreduce(x, op, out=out, name=name)


# --------------------------------------------------------------------------- allreduce
@torch.no_grad()
def _allreduce_on(comm: Communicator, tensor: torch.Tensor, op: str, prescale: float, postscale: float,
                  codec: Any = None, compressor: Any = None, inplace: bool = False,
                  name: str | None = None) -> torch.Tensor:
    """Run on a lane: compress, prescale, reduce (int averages truncate), postscale, decompress."""
    x, ctx = compressor.compress(tensor) if compressor is not None else (tensor, None)
    plain = x is tensor and prescale == 1.0 and postscale == 1.0 and not _int_average(tensor, op)
    if plain:
        result = _core_reduce(comm, tensor.detach(), op, name, codec, out=tensor.detach() if inplace else None)
    else:
        x = _scale(x.detach(), prescale)
        int_avg = _int_average(x, op)
        result = _core_reduce(comm, x, Sum if int_avg else op, name, codec)
        if int_avg:
            result = torch.div(result, comm.size, rounding_mode="trunc")
        result = _scale(result, postscale)
        if compressor is not None:
            result = compressor.decompress(result, ctx)
        if inplace:
            tensor.detach().copy_(result)
            result = tensor
    return tensor if inplace else result


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> HorovodHandle:
    """Start an all-reduce of ``tensor`` (default op: Average); ``synchronize`` gives a new tensor."""
    op = _resolve_op(average, op)
    return _submit(process_set, _allreduce_on, tensor, op, prescale_factor, postscale_factor, name=name)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> HorovodHandle:
    """Start an in-place all-reduce of ``tensor``; ``synchronize`` returns ``tensor``."""
    op = _resolve_op(average, op)
    return _submit(process_set, _allreduce_on, tensor, op, prescale_factor, postscale_factor, inplace=True,
                   name=name)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: str, name: str | None, prescale: float, postscale: float,
                process_set: Any, codec: Any, compressor: Any) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return _call(process_set, _allreduce_on, tensor, op, prescale, postscale, codec, compressor,
                       name=name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, prescale, postscale, process_set = ctx.args
        reduced = _call(process_set, _allreduce_on, grad.contiguous(), op, prescale, postscale)
        return (reduced,) + (None,) * 7


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """Return ``tensor`` reduced over the process set (default op: Average); differentiable.

    ``compression`` is a Horovod Compressor (``Compression.fp16``, your own) or a
    commwire codec (``Compression.fp8``, ``"ef+nvfp4"``), which runs commwire's
    compressed all-reduce.
    """
    op = _resolve_op(average, op)
    codec, compressor = resolve(compression)
    return _Allreduce.apply(tensor, op, name, prescale_factor, postscale_factor, process_set, codec, compressor)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the process set in place and return it."""
    op = _resolve_op(average, op)
    return _call(process_set, _allreduce_on, tensor, op, prescale_factor, postscale_factor, inplace=True, name=name)


# --------------------------------------------------------------------------- grouped allreduce
# The per-tensor checks below run over every tensor of every call: ``map`` over a C-level getter
# costs a tenth of a generator expression, which for many small tensors would dominate the group.
_dtype_of = operator.attrgetter("dtype")
_needs_grad = operator.attrgetter("requires_grad")


def _dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]] | Invalid:
    """Return the indices of ``tensors`` per dtype (first-appearance order), or Invalid if devices differ."""
    if len(set(map(torch.Tensor.get_device, tensors))) > 1:  # -1 for the CPU, else the CUDA device index
        devices = sorted({str(t.device) for t in tensors})
        return Invalid(RuntimeError(f"a grouped collective needs every tensor on one device, got {devices}; "
                                    "group the CPU and the GPU tensors separately"))
    if len(set(map(_dtype_of, tensors))) <= 1:
        return [list(range(len(tensors)))]
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _pack(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], Any, list[torch.Tensor], list[int] | None]]:
    """Fuse ``tensors`` into one flat buffer per dtype: [(indices, flat, members, sizes)] in first-appearance order.

    ``sizes`` lists the lengths when every member of the group is 1-D (``_unpack`` then splits in
    one call), else None.
    """
    groups = _dtype_groups(tensors)
    if isinstance(groups, Invalid):
        return [(list(range(len(tensors))), groups, list(tensors), None)]
    packed = []
    for idx in groups:
        like = list(tensors) if len(groups) == 1 else [tensors[i] for i in idx]
        if not like:
            packed.append((idx, torch.empty(0), like, []))
        elif set(map(torch.Tensor.dim, like)) == {1}:
            # ``cat`` of 1-D tensors costs a fraction of flatten_dense_tensors (what DDP uses, any
            # shape) per tensor, and far less than a Python loop of reshape calls.
            packed.append((idx, torch.cat(like), like, list(map(torch.Tensor.numel, like))))
        else:
            packed.append((idx, _flatten_dense_tensors(like), like, None))
    return packed


def _unpack(flat: torch.Tensor, like: list[torch.Tensor], idx: list[int], sizes: list[int] | None,
            out: list[Any]) -> None:
    """Put the views of ``flat`` shaped like the group's members ``like`` into ``out[idx]``."""
    pieces = flat.split(sizes) if sizes is not None else _unflatten_dense_tensors(flat, like)
    if len(idx) == len(out):
        out[:] = pieces
        return
    for i, piece in zip(idx, pieces):
        out[i] = piece


@torch.no_grad()
def _grouped_allreduce_on(comm: Communicator, tensors: Sequence[torch.Tensor], op: str, prescale: float,
                          postscale: float, codec: Any = None, compressor: Any = None, inplace: bool = False,
                          name: str | None = None) -> list[torch.Tensor]:
    results: list[Any] = [None] * len(tensors)
    for k, (idx, flat, like, sizes) in enumerate(_pack(tensors)):
        label = None if name is None else f"{name}.{k}"
        if isinstance(flat, Invalid):
            _core_reduce(comm, flat, op, label, None)  # raises on every rank
        reduced = _allreduce_on(comm, flat, op, prescale, postscale, codec, compressor, name=label)
        _unpack(reduced, like, idx, sizes, results)
    if inplace:
        torch._foreach_copy_([t.detach() for t in tensors], results)
        return list(tensors)
    return results


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> HorovodHandle:
    """Start one fused all-reduce of ``tensors``; ``synchronize`` gives a list of new tensors."""
    op = _resolve_op(average, op)
    return _submit(process_set, _grouped_allreduce_on, list(tensors), op, prescale_factor, postscale_factor,
                   name=name)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> HorovodHandle:
    """Start one fused in-place all-reduce of ``tensors``; ``synchronize`` returns them."""
    op = _resolve_op(average, op)
    return _submit(process_set, _grouped_allreduce_on, list(tensors), op, prescale_factor, postscale_factor,
                   inplace=True, name=name)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: str, name: str | None, prescale: float, postscale: float, process_set: Any,
                codec: Any, compressor: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_call(process_set, _grouped_allreduce_on, list(tensors), op, prescale, postscale, codec,
                             compressor, name=name))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, prescale, postscale, process_set = ctx.args
        reduced = _call(process_set, _grouped_allreduce_on, [g.contiguous() for g in grads], op, prescale,
                          postscale)
        return (None,) * 7 + tuple(reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Return ``tensors`` reduced over the process set, fused into one collective per dtype; differentiable."""
    op = _resolve_op(average, op)
    codec, compressor = resolve(compression)
    if not (torch.is_grad_enabled() and any(map(_needs_grad, tensors))):
        # No graph to record: skip autograd's per-input bookkeeping (about 1 µs per tensor).
        return _call(process_set, _grouped_allreduce_on, list(tensors), op, prescale_factor, postscale_factor,
                     codec, compressor, name=name)
    return list(_GroupedAllreduce.apply(op, name, prescale_factor, postscale_factor, process_set, codec,
                                        compressor, *tensors))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce ``tensors`` in place, fused; return them."""
    op = _resolve_op(average, op)
    return _call(process_set, _grouped_allreduce_on, list(tensors), op, prescale_factor, postscale_factor,
                 inplace=True, name=name)


# --------------------------------------------------------------------------- allgather
@torch.no_grad()
def _allgather_on(comm: Communicator, tensor: torch.Tensor, codec: Any = None, compressor: Any = None,
                  name: str | None = None) -> torch.Tensor:
    if compressor is not None:
        x, ctx = compressor.compress(tensor.detach())
        return compressor.decompress(comm.allgather(x, name=name), ctx)
    if codec is not None:  # each rank's rows encoded once; every rank decodes all (commwire.codecs.sharded)
        from ..codecs.sharded import compressed_allgather

        return compressed_allgather(comm, tensor.detach(), codec=codec, name=name)
    return comm.allgather(tensor.detach(), name=name)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set,
                    compression: Any = Compression.none) -> HorovodHandle:
    """Start an all-gather (concatenation along dimension 0; first dimensions may differ).

    ``compression`` (commwire's extension): a Compressor or a codec spec such as ``"fp8-e4m3"``.
    """
    codec, compressor = resolve(compression)
    return _submit(process_set, _allgather_on, tensor, codec, compressor, name=name)


def _rows_before(first_dim: int, process_set: Any) -> int:
    dims = _call(process_set, _allgather_on, torch.tensor([first_dim], dtype=torch.int64))
    me = comm_of(process_set).rank
    return int(dims[:me].sum())


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: Any, codec: Any,
                compressor: Any) -> torch.Tensor:
        ctx.shape, ctx.process_set = tensor.shape, process_set
        return _call(process_set, _allgather_on, tensor, codec, compressor, name=name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = _call(ctx.process_set, _allreduce_on, grad.contiguous(), Average, 1.0, 1.0)
        rows = int(ctx.shape[0]) if len(ctx.shape) else 1
        offset = _rows_before(rows, ctx.process_set)
        return reduced.narrow(0, offset, rows).reshape(ctx.shape), None, None, None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set,
              compression: Any = Compression.none) -> torch.Tensor:
    """Return every member's ``tensor`` concatenated along dimension 0; differentiable.

    ``compression`` (commwire's extension): a Compressor or a codec spec such as ``"fp8-e4m3"``
    (every rank then holds the same decoded values, its own rows included).
    """
    codec, compressor = resolve(compression)
    return _Allgather.apply(tensor, name, process_set, codec, compressor)


@torch.no_grad()
def _grouped_allgather_on(comm: Communicator, tensors: Sequence[torch.Tensor], codec: Any = None,
                          compressor: Any = None, name: str | None = None) -> list[torch.Tensor]:
    """Gather several tensors in two collectives: their row counts and shapes, then all bytes fused."""
    if compressor is not None:
        pairs = [compressor.compress(t.detach()) for t in tensors]
        gathered = _grouped_allgather_on(comm, [p[0] for p in pairs], name=name)
        return [compressor.decompress(g, ctx) for g, (_, ctx) in zip(gathered, pairs)]
    if codec is not None:  # one compressed all-gather per tensor: each carries its own scales
        return [_allgather_on(comm, t, codec, name=None if name is None else f"{name}.{i}")
                for i, t in enumerate(tensors)]
    tensors = [t.detach().contiguous() for t in tensors]
    meta = torch.tensor([[t.shape[0] if t.dim() else 1, _row_elems(t), t.element_size()] for t in tensors],
                        dtype=torch.int64).reshape(-1, 3)
    everyone = comm.allgather(meta.unsqueeze(0), name=None if name is None else f"{name}.meta")
    everyone = everyone.reshape(comm.size, len(tensors), 3)
    if (everyone[:, :, 1:] != everyone[:1, :, 1:]).any():
        raise ValueError(f"grouped_allgather {name!r}: the tensors' shapes past the first dimension or their dtypes "
                         f"differ between ranks (rows, row elements, item bytes per rank: {everyone.tolist()})")
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else \
        torch.empty(0, dtype=torch.uint8)
    gathered = comm.allgather(flat, name=name)
    sizes = (everyone[:, :, 0] * everyone[:, :, 1] * everyone[:, :, 2]).tolist()
    per_rank = gathered.split([sum(row) for row in sizes])
    pieces = [chunk.split(row) for chunk, row in zip(per_rank, sizes)]
    out = []
    for i, t in enumerate(tensors):
        data = torch.cat([pieces[r][i] for r in range(comm.size)]).view(t.dtype)
        out.append(data.view((-1,) + tuple(t.shape[1:])) if t.dim() else data)
    return out


def _row_elems(t: torch.Tensor) -> int:
    return int(np.prod(tuple(t.shape[1:]), dtype=np.int64)) if t.dim() else 1


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set, compression: Any = Compression.none
                            ) -> HorovodHandle:
    """Start a fused all-gather of ``tensors``; ``synchronize`` gives a list of tensors."""
    codec, compressor = resolve(compression)
    return _submit(process_set, _grouped_allgather_on, list(tensors), codec, compressor, name=name)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: Any, codec: Any, compressor: Any,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dims, ctx.process_set = [int(t.shape[0]) for t in tensors], process_set
        return tuple(_call(process_set, _grouped_allgather_on, list(tensors), codec, compressor, name=name))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = _call(ctx.process_set, _grouped_allreduce_on, [g.contiguous() for g in grads], Average, 1.0,
                          1.0)
        offsets = _call(ctx.process_set, _allgather_on, torch.tensor([ctx.dims], dtype=torch.int64))
        me = comm_of(ctx.process_set).rank
        before = offsets[:me].sum(dim=0).tolist()
        return (None,) * 4 + tuple(r.narrow(0, int(o), d) for r, o, d in zip(reduced, before, ctx.dims))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set, compression: Any = Compression.none
                      ) -> list[torch.Tensor]:
    """Return each tensor gathered from every member (fused); differentiable.

    ``compression`` (commwire's extension): a Compressor or a codec spec such as ``"fp8-e4m3"``.
    """
    codec, compressor = resolve(compression)
    return list(_GroupedAllgather.apply(name, process_set, codec, compressor, *tensors))


# --------------------------------------------------------------------------- broadcast
@torch.no_grad()
def _broadcast_on(comm: Communicator, tensor: torch.Tensor, root: Any, inplace: bool = False,
                  name: str | None = None) -> torch.Tensor:
    data = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor  # an Invalid stays itself
    result = comm.broadcast(data, root, out=data if inplace else None, name=name)
    return tensor if inplace else result


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> HorovodHandle:
    """Start a broadcast of root's ``tensor`` (``root_rank``: a global rank); ``synchronize`` gives a new tensor."""
    return _submit(process_set, _broadcast_on, *_rooted(tensor, root_rank, process_set), name=name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> HorovodHandle:
    """Start an in-place broadcast into ``tensor``; ``synchronize`` returns it."""
    return _submit(process_set, _broadcast_on, *_rooted(tensor, root_rank, process_set), inplace=True, name=name)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: Any) -> torch.Tensor:
        ctx.root, ctx.process_set = root_rank, process_set
        return _call(process_set, _broadcast_on, *_rooted(tensor, root_rank, process_set), name=name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = _call(ctx.process_set, _allreduce_on, grad.contiguous(), Average, 1.0, 1.0)
        if rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Return root's ``tensor`` on every member (a new tensor); differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with root's, in place, and return it."""
    return _call(process_set, _broadcast_on, *_rooted(tensor, root_rank, process_set), inplace=True, name=name)


# --------------------------------------------------------------------------- alltoall
@torch.no_grad()
def _alltoall_on(comm: Communicator, tensor: torch.Tensor, splits: Any,
                 name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    result, received = comm.alltoallv(tensor.detach(), splits, name=name)
    received_t = torch.from_numpy(received.astype(np.int32))
    if isinstance(splits, torch.Tensor):
        received_t = received_t.to(splits.device)
    return result, received_t


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> HorovodHandle:
    """Start an all-to-all; ``synchronize`` gives (received rows, rows received from each member)."""
    return _submit(process_set, _alltoall_on, tensor, splits, name=name)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any) -> Any:
        output, received = _call(process_set, _alltoall_on, tensor, splits, name=name)
        ctx.process_set, ctx.received = process_set, received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple[Any, ...]:
        back, _ = _call(ctx.process_set, _alltoall_on, grad.contiguous(), ctx.received.cpu())
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Send ``splits[i]`` rows to member i (equal blocks without ``splits``); differentiable.

    Returns the rows received, and with ``splits`` also how many came from each member.
    """
    return _Alltoall.apply(tensor, splits, name, process_set)


# --------------------------------------------------------------------------- reducescatter
@torch.no_grad()
def _reducescatter_on(comm: Communicator, tensor: torch.Tensor, op: str, prescale: float, postscale: float,
                      codec: Any = None, compressor: Any = None, counts: Any = None,
                      name: str | None = None) -> torch.Tensor:
    x, ctx = compressor.compress(tensor.detach()) if compressor is not None else (tensor.detach(), None)
    x = _scale(x, prescale)
    if codec is not None:  # commwire's codec on the wire: blocks encoded by their senders, summed in FP32
        from ..codecs.sharded import compressed_reduce_scatter

        return _scale(compressed_reduce_scatter(comm, x, op, codec=codec, counts=counts, name=name), postscale)
    int_avg = _int_average(x, op)
    result = comm.reduce_scatter(x, Sum if int_avg else op, name=name, counts=counts)
    if int_avg:
        result = torch.div(result, comm.size, rounding_mode="trunc")
    result = _scale(result, postscale)
    return compressor.decompress(result, ctx) if compressor is not None else result


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, compression: Any = Compression.none) -> HorovodHandle:
    """Start a reduce-scatter (rows split as evenly as possible, the first members get one more).

    ``compression`` (commwire's extension): a Compressor or a commwire codec spec, as for ``reducescatter``.
    """
    codec, compressor = resolve(compression)
    return _submit(process_set, _reducescatter_on, tensor, normalize_op(op), prescale_factor, postscale_factor,
                   codec, compressor, name=name)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: str, process_set: Any, prescale: float,
                postscale: float, codec: Any, compressor: Any) -> torch.Tensor:
        ctx.args = (op, process_set, prescale * postscale)
        return _call(process_set, _reducescatter_on, tensor, op, prescale, postscale, codec, compressor,
                       name=name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, process_set, scale = ctx.args
        if op == Sum:
            scale = scale * comm_of(process_set).size
        grad = grad * scale if scale != 1.0 else grad
        return _call(process_set, _allgather_on, grad.contiguous()), None, None, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: Any = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Return this member's block of rows of ``tensor`` reduced over the process set; differentiable.

    ``compression``: a Horovod Compressor (applied around the collective) or a commwire codec spec
    such as ``"ef+fp8-e4m3"`` (each block travels encoded; ``commwire.codecs.sharded``).
    """
    codec, compressor = resolve(compression)
    return _Reducescatter.apply(tensor, name, normalize_op(op), process_set, prescale_factor, postscale_factor,
                                codec, compressor)


@torch.no_grad()
def _grouped_reducescatter_on(comm: Communicator, tensors: Sequence[torch.Tensor], op: str, prescale: float,
                              postscale: float, codec: Any = None, compressor: Any = None,
                              name: str | None = None) -> list[torch.Tensor]:
    """Reduce-scatter several tensors fused: each member's blocks of every tensor travel together."""
    if compressor is not None:  # Horovod's Compressors work tensor by tensor, around the fused collective
        pairs = [compressor.compress(t.detach()) for t in tensors]
        reduced = _grouped_reducescatter_on(comm, [p[0] for p in pairs], op, prescale, postscale, codec, None,
                                            name=name)
        return [compressor.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]
    from ..comm.buffers import split_rows

    results: list[Any] = [None] * len(tensors)
    groups = _dtype_groups(tensors)
    if isinstance(groups, Invalid):
        comm.reduce_scatter(groups, op, name=name)  # raises on every rank
    for k, idx in enumerate(groups):
        label = None if name is None else f"{name}.{k}"
        group = [tensors[i].detach() for i in idx]
        if any(t.dim() == 0 for t in group):
            bad = Invalid(ValueError("grouped_reducescatter needs tensors with at least one dimension, got a scalar"))
            comm.reduce_scatter(bad, op, name=label)  # raises on every rank
        splits = [split_rows(t.shape[0], comm.size) for t in group]
        blocks = [[t[int(s[:r].sum()):int(s[:r + 1].sum())].reshape(-1) for r in range(comm.size)]
                  for t, s in zip(group, splits)]
        packed = torch.cat([blocks[j][r] for r in range(comm.size) for j in range(len(group))])
        counts = np.array([sum(b[r].numel() for b in blocks) for r in range(comm.size)], dtype=np.int64)
        mine = _reducescatter_on(comm, packed, op, prescale, postscale, codec, counts=counts, name=label)
        sizes = [b[comm.rank].numel() for b in blocks]
        for i, t, piece, s in zip(idx, group, mine.split(sizes), splits):
            results[i] = piece.view((int(s[comm.rank]),) + tuple(t.shape[1:]))
    return results


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: Any = Average,
                                process_set: Any = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, compression: Any = Compression.none
                                ) -> HorovodHandle:
    """Start a fused reduce-scatter of ``tensors``; ``synchronize`` gives a list of blocks."""
    codec, compressor = resolve(compression)
    return _submit(process_set, _grouped_reducescatter_on, list(tensors), normalize_op(op), prescale_factor,
                   postscale_factor, codec, compressor, name=name)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: str, process_set: Any, prescale: float, postscale: float,
                codec: Any, compressor: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, process_set, prescale * postscale)
        return tuple(_call(process_set, _grouped_reducescatter_on, list(tensors), op, prescale, postscale, codec,
                           compressor, name=name))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, process_set, scale = ctx.args
        if op == Sum:
            scale = scale * comm_of(process_set).size
        grads = tuple(g * scale if scale != 1.0 else g for g in grads)
        gathered = _call(process_set, _grouped_allgather_on, [g.contiguous() for g in grads])
        return (None,) * 7 + tuple(gathered)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter each tensor, fused into one collective per dtype; differentiable.

    ``compression``: a Horovod Compressor (applied to each tensor) or a commwire codec spec.
    """
    codec, compressor = resolve(compression)
    return list(_GroupedReducescatter.apply(name, normalize_op(op), process_set, prescale_factor,
                                            postscale_factor, codec, compressor, *tensors))


# --------------------------------------------------------------------------- sparse, join, barrier
def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any,
                           process_set: Any = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor by all-gathering its indices and values; call the result to wait."""
    op = normalize_op(op)

    def gather(x: torch.Tensor, part: str) -> Callable[[], torch.Tensor]:
        handle = allgather_async(x, name=part, process_set=process_set)
        return lambda: synchronize(handle)

    return _sparse_allreduce(tensor, name, op == Average, comm_of(process_set).size, gather)


def _sparse_allreduce(tensor: torch.Tensor, name: str, average: bool, members: int,
                      gather: Callable[[torch.Tensor, str], Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO tensor over ``members`` ranks; call the result to wait for the reduced tensor.

    The sum of sparse tensors is their concatenation (coalescing adds the duplicates), so
    every rank all-gathers the (index, value) pairs: ``gather(x, part_name)`` starts the
    all-gather of ``x`` and returns a function that waits for it. ``average`` divides by
    ``members``.
    """
    t = tensor.coalesce()
    indices = gather(t._indices().t().contiguous(), f"{name}.indices")
    values = gather(t._values().contiguous(), f"{name}.values")

    def result() -> torch.Tensor:
        vals = values()
        idx = indices()
        if average:
            vals = vals / members
        return torch.sparse_coo_tensor(idx.t(), vals, t.size(), check_invariants=False).coalesce()

    return result


def join(device: int = -1) -> int:
    """Take part in the other ranks' all-reduces with zeros until every rank has joined; return the last one."""
    return comm_of(global_process_set).call(Communicator.join)


def barrier(process_set: Any = global_process_set) -> None:
    """Block until every member of the process set has called barrier (collectives in flight continue)."""
    comm_of(process_set).barrier()
