"""Adapt numpy arrays, torch tensors and cupy arrays to buffers MPI can move.

Every collective works on a *host view* (a numpy array sharing memory with the
input where possible) or, for CUDA buffers with a CUDA-aware MPI, on the device
array itself. One adapter per array kind turns an input into that buffer and
turns a result buffer back into the input's kind, on the input's device.

Device arrays (torch CUDA tensors, cupy arrays) are prepared on their device
in both modes by :class:`DeviceOps` (contiguous copy, float32 work copy of the
half types, the order-preserving integer form of float min/max): a CUDA-aware
MPI then gets the device buffers, otherwise they are staged through pinned host
memory. Stream rules: MPI knows no CUDA streams, so the current stream is
synchronised before MPI reads a device buffer; a collective that runs on a
background lane runs its device work on a side stream ordered after the
caller's work at submission (:class:`StreamOrder`), and the caller's stream
waits for it when the handle is waited for.

``cpu_standin()`` makes torch CPU tensors count as device arrays, so that the
device paths (and their agreement) run and are tested on machines without a GPU:
mpi4py takes torch CPU tensors as buffers (DLPack) as it takes CUDA ones.

The codec kernels take flat float32 vectors and uint8 buffers of the input's
kind and device (:func:`flat_f32`, :func:`empty_u8`, :func:`empty_f32`,
:func:`restore`); cupy arrays reach them as torch tensors through DLPack
(:func:`to_torch`, :func:`from_torch`).

torch and cupy are imported lazily, only when such an array is passed in.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
    "BFLOAT16",
    "SUPPORTED_DTYPES",
    "Adapter",
    "DeviceOps",
    "DtypeSet",
    "FLOAT_NAMES",
    "Invalid",
    "StreamOrder",
    "adapter_for",
    "array_module",
    "bfloat16",
    "check_dtype",
    "copy",
    "cpu_standin",
    "device_ops",
    "dtype_name",
    "empty_f32",
    "empty_u8",
    "flat_f32",
    "from_torch",
    "host_view",
    "is_bfloat16",
    "is_device_array",
    "kind_of",
    "nbytes",
    "restore",
    "stream_order",
    "to_torch",
    "zeros",
    "zeros_like",
]

_BFLOAT16: np.dtype | None = None


def bfloat16() -> np.dtype:
    """Return ml_dtypes' bfloat16 dtype, importing ml_dtypes on first use.

    Not at import: ml_dtypes 0.7 takes ~0.8 s to import, paid by every rank of every job.
    """
    global _BFLOAT16
    if _BFLOAT16 is None:
        _BFLOAT16 = _ml_dtype("bfloat16")
    return _BFLOAT16


def is_bfloat16(dtype: Any) -> bool:
    """Return whether numpy dtype ``dtype`` is ml_dtypes' bfloat16 (without importing ml_dtypes:
    an array of that dtype exists only where ml_dtypes has been imported)."""
    return "ml_dtypes" in sys.modules and dtype == bfloat16()


class DtypeSet:
    """A set of numpy dtypes, optionally with ml_dtypes' bfloat16, matched without importing ml_dtypes."""

    __slots__ = ("dtypes", "bf16")

    def __init__(self, *dtypes: Any, bf16: bool = False) -> None:
        self.dtypes, self.bf16 = frozenset(np.dtype(d) for d in dtypes), bf16

    def __contains__(self, dtype: Any) -> bool:
        return dtype in self.dtypes or (self.bf16 and isinstance(dtype, np.dtype) and is_bfloat16(dtype))


# dtypes every collective accepts (data moves: all; reductions: see commwire.comm.reduce);
# reductions of the two half types run in float32 because MPI has no 16-bit float arithmetic.
_SUPPORTED_NAMES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                    "uint32", "uint64", "bool")
_SUPPORTED = DtypeSet(*(n for n in _SUPPORTED_NAMES if n != "bfloat16"), bf16=True)
HALF_DTYPES = DtypeSet(np.float16, bf16=True)


def _ml_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


def __getattr__(name: str) -> Any:
    # BFLOAT16 and SUPPORTED_DTYPES, made on first use (they import ml_dtypes)
    if name == "BFLOAT16":
        return bfloat16()
    if name == "SUPPORTED_DTYPES":
        return tuple(bfloat16() if n == "bfloat16" else np.dtype(n) for n in _SUPPORTED_NAMES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------ generic array helpers
# Small operations every layer needs on numpy arrays, torch tensors and cupy arrays alike.
def kind_of(x: Any) -> str:
    """Return ``"numpy"``, ``"torch"`` or ``"cupy"`` for an array, else raise TypeError."""
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__.split(".")[0]
    if module in ("torch", "cupy"):
        return module
    raise TypeError(f"expected a numpy array, torch tensor or cupy array, got {type(x).__name__}; "
                    "convert with numpy.asarray(x)")


def array_module(x: Any) -> Any:
    """Return the module whose functions apply to ``x``: numpy, torch or cupy."""
    kind = kind_of(x)
    if kind == "numpy":
        return np
    return sys.modules[kind] if kind in sys.modules else __import__(kind)


def nbytes(x: Any) -> int:
    """Return the bytes ``x``'s elements occupy."""
    return int(x.nbytes) if not hasattr(x, "element_size") else x.numel() * x.element_size()


def zeros(like: Any, shape: int | tuple[int, ...], dtype: Any = None) -> Any:
    """Return zeros of ``shape`` of ``like``'s kind and device, in ``dtype`` (default: ``like``'s)."""
    if isinstance(like, np.ndarray) or kind_of(like) == "cupy":
        return array_module(like).zeros(shape, dtype=like.dtype if dtype is None else dtype)
    import torch

    return torch.zeros(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def zeros_like(x: Any) -> Any:
    """Return zeros of ``x``'s shape, dtype, kind and device (detached from autograd)."""
    return zeros(x, tuple(x.shape))


def copy(x: Any) -> Any:
    """Return an independent copy of ``x`` (detached from autograd for torch tensors)."""
    return x.detach().clone() if kind_of(x) == "torch" else x.copy()


_dtype_names: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """Return the short name of a numpy/torch/cupy dtype (``"float32"``, ``"bfloat16"``, ``"int64"``)."""
    # str() of a dtype takes microseconds, as long as a small codec kernel: cache it per dtype.
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).replace("torch.", "")
    return name


# ------------------------------------------------------------------ flat float32 work vectors
# The codec kernels take flat float32 vectors and uint8 buffers: numpy arrays on the host,
# torch tensors on any device. cupy arrays are viewed as torch tensors through DLPack (zero
# copy) and results are viewed back, so cupy needs no kernels of its own.
FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
"""Names (:func:`dtype_name`) of the element types that codecs encode."""


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch
    try:
        import torch
    except ImportError:
        raise ImportError("torch tensors need torch: pip install 'commwire[torch]'") from None
    return torch


def to_torch(x: Any) -> Any:
    """View a cupy array as a torch tensor (DLPack, zero copy); pass torch tensors through."""
    torch = _torch()
    return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)


def from_torch(t: Any, kind: str) -> Any:
    """Return ``t`` as the array kind it came from (cupy via DLPack)."""
    if kind == "cupy":
        import cupy

        return cupy.from_dlpack(t)
    return t


def flat_f32(x: Any, kind: str) -> Any:
    """Return a contiguous 1-D float32 copy or view of ``x`` (numpy, or torch for torch and cupy)."""
    if kind == "numpy":
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    torch = _torch()
    return to_torch(x).reshape(-1).to(torch.float32).contiguous()


def empty_u8(like: Any, n: int) -> Any:
    """Allocate ``n`` uninitialised bytes (uint8) on the same device as ``like``."""
    if isinstance(like, np.ndarray):
        return np.empty(n, np.uint8)
    torch = _torch()
    return torch.empty(n, dtype=torch.uint8, device=like.device)


def empty_f32(like: Any, n: int) -> Any:
    """Allocate an uninitialised float32 vector of ``n`` elements on the same device as ``like``."""
    if isinstance(like, np.ndarray):
        return np.empty(n, np.float32)
    torch = _torch()
    return torch.empty(n, dtype=torch.float32, device=like.device)


def restore(flat: Any, shape: tuple[int, ...], dtype: str, kind: str, out: Any = None) -> Any:
    """Reshape a float32 vector to ``shape`` and cast it to the dtype named ``dtype``, into ``out`` if given."""
    if kind == "numpy":
        target = np.dtype(dtype) if hasattr(np, dtype) else _ml_dtype(dtype)
        result = flat.reshape(shape)
        if out is not None:
            if out.shape != tuple(shape):
                raise ValueError(f"out has shape {out.shape}, the payload holds shape {tuple(shape)}")
            np.copyto(out, result, casting="unsafe")
            return out
        return result if target == np.float32 else result.astype(target)
    torch = _torch()
    result = flat.reshape(shape).to(getattr(torch, dtype))
    if out is not None:
        target = to_torch(out)
        if tuple(target.shape) != tuple(shape):
            raise ValueError(f"out has shape {tuple(target.shape)}, the payload holds shape {tuple(shape)}")
        target.copy_(result)
        return out
    return from_torch(result, kind)


def check_dtype(dtype: np.dtype) -> None:
    """Raise TypeError if ``dtype`` is not one commwire can communicate."""
    if dtype not in _SUPPORTED:
        names = ", ".join(_SUPPORTED_NAMES)
        raise TypeError(f"dtype {dtype_name(dtype)} is not supported; use one of {names} (cast first)")


class Adapter:
    """Convert one kind of array to and from buffers MPI can use."""

    kind = "numpy"
    on_device = False

    def host(self, x: Any) -> np.ndarray:
        """Return a contiguous numpy view of ``x`` (a copy only if it must be)."""
        if isinstance(x, np.ndarray) and x.flags.c_contiguous:
            return x
        # ascontiguousarray turns 0-d input into shape (1,): keep the caller's shape
        return np.ascontiguousarray(x).reshape(np.shape(x))

    def release(self, host: np.ndarray) -> None:
        """Return a staging buffer handed out by ``host`` to the pool."""

    def wrap(self, host: np.ndarray, like: Any) -> Any:
        """Return ``host`` as an array of the same kind and device as ``like``."""
        return host

    def out_view(self, out: Any) -> np.ndarray | None:
        """Return a numpy view that writes into ``out``'s memory, or None if there is none."""
        if isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable:
            return out
        return None

    def write(self, out: Any, host: np.ndarray) -> Any:
        """Copy ``host`` into the caller's ``out`` array unless they share memory."""
        # Into `out` itself: a strided array's host() is a contiguous copy, which nobody would read.
        target = out if isinstance(out, np.ndarray) else self.host(out)
        if not np.shares_memory(target, host):
            np.copyto(target, host.reshape(target.shape), casting="no")
        return out


class _TorchAdapter(Adapter):
    kind = "torch"

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self._bf16 = torch.bfloat16
        self._pool: dict[tuple[Any, int], list[Any]] = {}
        self._lent: dict[int, tuple[tuple[Any, int], Any]] = {}

    def host(self, x: Any) -> np.ndarray:
        t = x.detach()
        if t.is_cuda:
            t = self._stage(t)
        if not t.is_contiguous():
            t = t.contiguous()  # non-contiguous tensors are copied, never misread
        if t.dtype == self._bf16:
            return t.view(self.torch.int16).numpy().view(bfloat16())
        try:
            return t.numpy()
        except TypeError as exc:
            raise TypeError(f"dtype {dtype_name(t.dtype)} is not supported; cast the tensor first") from exc

    def _stage(self, t: Any) -> Any:
        # Reuse pinned host buffers so a host-staged CUDA collective does not pay
        # a page-locked allocation every call; a buffer returns to the pool in
        # release() once the collective that used it has completed.
        key = (t.dtype, t.numel())
        pool = self._pool.setdefault(key, [])
        buf = pool.pop() if pool else self.torch.empty(t.numel(), dtype=t.dtype, pin_memory=t.is_cuda)
        buf.copy_(t.reshape(-1))
        self._lent[buf.data_ptr()] = (key, buf)
        return buf.view(t.shape)

    def release(self, host: np.ndarray) -> None:
        entry = self._lent.pop(host.__array_interface__["data"][0], None)
        if entry is not None:
            self._pool[entry[0]].append(entry[1])

    def wrap(self, host: np.ndarray, like: Any) -> Any:
        if is_bfloat16(host.dtype):
            t = self.torch.from_numpy(host.view(np.int16)).view(self._bf16)
        else:
            t = self.torch.from_numpy(host)
        if like.is_cuda:
            t = t.to(like.device, non_blocking=False)
        return t

    def out_view(self, out: Any) -> np.ndarray | None:
        if out.is_cuda or not out.is_contiguous() or out.requires_grad:
            return None
        return self.host(out)

    def write(self, out: Any, host: np.ndarray) -> Any:
        if out.is_cuda or not out.is_contiguous():
            out.copy_(self.wrap(host, out).reshape(out.shape))
            return out
        return super().write(out, host)


class _CupyAdapter(Adapter):
    kind = "cupy"

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    def host(self, x: Any) -> np.ndarray:
        return np.ascontiguousarray(self.cupy.asnumpy(x)).reshape(tuple(x.shape))

    def wrap(self, host: np.ndarray, like: Any) -> Any:
        with self.cupy.cuda.Device(like.device.id):
            return self.cupy.asarray(host)

    def out_view(self, out: Any) -> np.ndarray | None:
        return None  # device memory: the result is copied back after the host reduction

    def write(self, out: Any, host: np.ndarray) -> Any:
        out[...] = self.cupy.asarray(host).reshape(out.shape)
        return out


_NUMPY = Adapter()
_adapters: dict[type, Adapter] = {np.ndarray: _NUMPY}


class Invalid:
    """Stand-in for an argument an adapter found invalid: a collective given it raises ``error``.

    Passing it (instead of raising) lets the collective's agreement protocol
    carry the error to every rank, so they all raise it together.
    """

    __slots__ = ("error", "shape", "dtype")

    def __init__(self, error: BaseException, shape: Any = None, dtype: Any = None) -> None:
        self.error, self.shape, self.dtype = error, shape, dtype


def adapter_for(x: Any) -> Adapter:
    """Return the adapter for ``x``'s array kind (numpy, torch or cupy)."""
    cls = type(x)
    adapter = _adapters.get(cls)
    if adapter is not None:
        return adapter
    if cls is Invalid:
        raise x.error
    module = cls.__module__.split(".", 1)[0]
    if module == "torch" and "torch" in sys.modules:
        adapter = _TorchAdapter(sys.modules["torch"])
    elif module == "cupy" and "cupy" in sys.modules:
        adapter = _CupyAdapter(sys.modules["cupy"])
    elif isinstance(x, (np.ndarray, np.generic)):
        adapter = _NUMPY  # numpy scalars travel as 0-d arrays
    elif np.isscalar(x) or isinstance(x, (list, tuple)):
        raise TypeError(
            f"expected a numpy array, torch tensor or cupy array, got {cls.__name__}; "
            "wrap it with numpy.asarray(...) first"
        )
    else:
        raise TypeError(f"unsupported array type {cls.__module__}.{cls.__name__}; use numpy, torch or cupy")
    _adapters[cls] = adapter
    return adapter


_standin = False  # cpu_standin(): torch CPU tensors take the device paths


@contextlib.contextmanager
def cpu_standin(enabled: bool = True) -> Iterator[None]:
    """Make torch CPU tensors count as device arrays inside the block (testing the device paths without a GPU).

    Every rank must enter it alike: whether an array is a device one is part of
    a collective's agreed signature.
    """
    global _standin
    before, _standin = _standin, bool(enabled)
    try:
        yield
    finally:
        _standin = before


def is_device_array(x: Any) -> bool:
    """Return True if ``x`` lives in GPU memory (torch CUDA tensor or cupy array), or stands in for such."""
    if type(x) is np.ndarray:
        return False
    if hasattr(x, "is_cuda"):
        return bool(x.is_cuda) or (_standin and type(x).__module__.startswith("torch"))
    return hasattr(x, "__cuda_array_interface__")


def host_view(x: Any) -> np.ndarray:
    """Return a contiguous numpy view (or copy) of any supported array."""
    return adapter_for(x).host(x)


# ------------------------------------------------------------------ device arrays
class DeviceOps:
    """The device-array operations the collectives need, for one library (torch or cupy).

    Every operation stays on the array's device and queues on the current
    stream; ``synchronize`` waits for that stream (MPI knows no streams).
    """

    lib: Any

    def numpy_dtype(self, x: Any) -> np.dtype:
        """Return the numpy dtype of ``x``'s elements (ml_dtypes' bfloat16 for bfloat16)."""
        raise NotImplementedError

    def synchronize(self, x: Any) -> None:
        """Wait for the work queued on the current stream of ``x``'s device."""
        raise NotImplementedError

    def ordered(self, x: Any, op: str) -> Any:
        """Return float32/float64 ``x`` as integers whose order is the floats' order, NaN winning ``op``.

        MPI's MIN/MAX on these are exact, deterministic and need no Python
        reduction (which would read device memory as host memory); NaN becomes
        the integer extreme that wins ``op``, so it propagates as numpy's does.
        """
        itype, mask = self._ordered_type(x)
        bits = x.view(itype)
        code = self.lib.where(bits < 0, bits ^ mask, bits)
        extreme = self._iinfo(itype)
        return self.lib.where(self.lib.isnan(x), extreme.min if op == "min" else extreme.max, code)

    def unordered(self, code: Any, dtype: np.dtype) -> Any:
        """Invert :meth:`ordered`: return the floats (of ``dtype``) the integers stand for."""
        itype, mask = self._ordered_type(code)
        return self.lib.where(code < 0, code ^ mask, code).view(self.dtype(dtype))

    def _ordered_type(self, x: Any) -> tuple[Any, int]:
        wide = x.dtype in (self.dtype(np.dtype(np.float64)), self.dtype(np.dtype(np.int64)))
        if wide:
            return self.dtype(np.dtype(np.int64)), (1 << 63) - 1
        return self.dtype(np.dtype(np.int32)), (1 << 31) - 1

    def dtype(self, dtype: np.dtype) -> Any:
        """Return this library's dtype for a numpy dtype."""
        raise NotImplementedError

    def _iinfo(self, itype: Any) -> Any:
        return self.lib.iinfo(itype)


class _TorchOps(DeviceOps):
    def __init__(self, torch: Any) -> None:
        self.lib = torch
        self._pool: dict[tuple[Any, int], list[Any]] = {}
        self._lent: dict[int, tuple[tuple[Any, int], Any]] = {}
        self._lock = threading.Lock()

    def numpy_dtype(self, x: Any) -> np.dtype:
        if x.dtype == self.lib.bfloat16:
            return bfloat16()
        try:
            return np.dtype(dtype_name(x.dtype))
        except TypeError:
            raise TypeError(f"dtype {dtype_name(x.dtype)} is not supported; cast the tensor first") from None

    def dtype(self, dtype: np.dtype) -> Any:
        return getattr(self.lib, "bfloat16" if is_bfloat16(dtype) else np.dtype(dtype).name)

    def contiguous(self, x: Any) -> Any:
        return x.detach().contiguous()

    def is_contiguous(self, x: Any) -> bool:
        return bool(x.is_contiguous())

    def clone(self, x: Any) -> Any:
        return x.detach().clone(memory_format=self.lib.contiguous_format)

    def float32(self, x: Any) -> Any:
        return x.detach().to(self.lib.float32).contiguous()

    def cast(self, x: Any, dtype: np.dtype) -> Any:
        return x.to(self.dtype(dtype))

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
        return self.lib.empty(shape, dtype=self.dtype(dtype), device=like.device)

    def bytes(self, x: Any) -> Any:
        flat = x.reshape(-1)
        return flat if flat.dtype == self.lib.uint8 else flat.view(self.lib.uint8)

    def divide_(self, x: Any, size: int) -> Any:
        # By a 0-d tensor on x's device: CUDA divides by a Python number as a multiplication by its
        # reciprocal (not bit-identical to the host path's division at sizes that are not powers of two).
        return x.div_(self.lib.full((), size, dtype=x.dtype, device=x.device))

    def copy_into(self, out: Any, result: Any) -> None:
        out.copy_(result.reshape(out.shape))

    def flat_copy(self, target: Any, source: Any) -> None:
        target.copy_(source.reshape(-1))

    def set_item(self, buf: Any, i: int, value: Any) -> None:
        buf[i] = value

    def item(self, buf: Any, i: int) -> Any:
        return buf[i].item()

    def synchronize(self, x: Any) -> None:
        if x.is_cuda:
            self.lib.cuda.current_stream(x.device).synchronize()

    def _iinfo(self, itype: Any) -> Any:
        return self.lib.iinfo(itype)

    def to_host(self, x: Any) -> np.ndarray:
        """Return a host copy of contiguous ``x`` for MPI (pinned and pooled for CUDA tensors; see release)."""
        if not x.is_cuda:
            return _torch_numpy(x.detach().clone())
        key = (x.dtype, x.numel())
        with self._lock:
            pool = self._pool.setdefault(key, [])
            buf = pool.pop() if pool else self.lib.empty(x.numel(), dtype=x.dtype, pin_memory=True)
            self._lent[buf.data_ptr()] = (key, buf)
        buf.copy_(x.reshape(-1))  # synchronous: waits for the current stream's work on x
        return _torch_numpy(buf).reshape(tuple(x.shape))

    def from_host(self, host: np.ndarray, like: Any) -> Any:
        """Return ``host`` as a tensor on ``like``'s device (a copy), and return its staging buffer to the pool."""
        t = self.lib.from_numpy(host.view(np.int16)).view(self.lib.bfloat16) if is_bfloat16(host.dtype) else \
            self.lib.from_numpy(host)
        result = t.to(like.device, copy=True)
        self.release(host)
        return result

    def release(self, host: np.ndarray) -> None:
        """Return a staging buffer of :meth:`to_host` to the pool (no-op for other arrays)."""
        with self._lock:
            entry = self._lent.pop(host.__array_interface__["data"][0], None)
            if entry is not None:
                self._pool[entry[0]].append(entry[1])


def _torch_numpy(t: Any) -> np.ndarray:
    import torch

    return t.view(torch.int16).numpy().view(bfloat16()) if t.dtype == torch.bfloat16 else t.numpy()


class _CupyOps(DeviceOps):
    def __init__(self, cupy: Any) -> None:
        self.lib = cupy

    def numpy_dtype(self, x: Any) -> np.dtype:
        return np.dtype(x.dtype)

    def dtype(self, dtype: np.dtype) -> Any:
        return np.dtype(dtype)

    def contiguous(self, x: Any) -> Any:
        return self.lib.ascontiguousarray(x)

    def is_contiguous(self, x: Any) -> bool:
        return bool(x.flags.c_contiguous)

    def clone(self, x: Any) -> Any:
        return self.lib.array(x, order="C", copy=True)

    def float32(self, x: Any) -> Any:
        return self.lib.ascontiguousarray(x, dtype=self.lib.float32)

    def cast(self, x: Any, dtype: np.dtype) -> Any:
        return x.astype(dtype)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
        with self.lib.cuda.Device(like.device.id):
            return self.lib.empty(shape, dtype=dtype)

    def bytes(self, x: Any) -> Any:
        return x.reshape(-1).view(self.lib.uint8)

    def divide_(self, x: Any, size: int) -> Any:
        x /= size
        return x

    def copy_into(self, out: Any, result: Any) -> None:
        out[...] = result.reshape(out.shape)

    def flat_copy(self, target: Any, source: Any) -> None:
        target[...] = source.reshape(-1)

    def set_item(self, buf: Any, i: int, value: Any) -> None:
        buf[i] = value

    def item(self, buf: Any, i: int) -> Any:
        return buf[i].item()

    def synchronize(self, x: Any) -> None:
        self.lib.cuda.get_current_stream().synchronize()

    def to_host(self, x: Any) -> np.ndarray:
        return self.lib.asnumpy(x)

    def from_host(self, host: np.ndarray, like: Any) -> Any:
        with self.lib.cuda.Device(like.device.id):
            return self.lib.asarray(host)

    def release(self, host: np.ndarray) -> None:
        """Nothing to return: cupy's copies are plain host arrays."""


_device_ops: dict[str, DeviceOps] = {}


def device_ops(x: Any) -> DeviceOps:
    """Return the :class:`DeviceOps` of a device array's library (torch or cupy)."""
    lib = "torch" if type(x).__module__.startswith("torch") else "cupy"
    ops = _device_ops.get(lib)
    if ops is None:
        ops = _device_ops[lib] = _TorchOps(sys.modules["torch"]) if lib == "torch" else _CupyOps(sys.modules["cupy"])
    return ops


# ------------------------------------------------------------------ stream order
_side_streams: dict[Any, Any] = {}
_side_lock = threading.Lock()


class StreamOrder:
    """Order a collective run on another thread (a lane) with the caller's CUDA stream.

    Made on the caller's thread: it records an event on the caller's current
    stream. On the worker, :meth:`worker` runs the device work on a side stream
    that first waits for that event (so MPI sees everything the caller queued
    before submitting, and nothing queued later delays it), and records a done
    event. :meth:`join`, on the caller's thread, makes the caller's current
    stream wait for the done event and tells torch's caching allocator that the
    results are used there (``record_stream``). Run on the caller's own thread,
    it does nothing: the caller's stream orders everything already.
    """

    __slots__ = ("_torch", "_device", "_event", "_thread", "_done")

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch, self._device = torch, device
        self._thread = threading.get_ident()
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))
        self._done: Any = None

    @contextlib.contextmanager
    def worker(self) -> Iterator[None]:
        """Run the block in order after the caller's work (on a side stream when on another thread)."""
        if threading.get_ident() == self._thread:
            yield
            return
        torch = self._torch
        side = _side_stream(torch, self._device)
        side.wait_event(self._event)
        with torch.cuda.stream(side):
            try:
                yield
            finally:
                done = torch.cuda.Event()
                done.record(side)
                self._done = done

    def join(self, result: Any) -> Any:
        """Make the caller's current stream wait for the worker's device work; return ``result``."""
        done = self._done
        if done is None:
            return result
        current = self._torch.cuda.current_stream(self._device)
        current.wait_event(done)
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, self._torch.Tensor) and t.is_cuda:
                t.record_stream(current)
        return result


class _CupyOrder(StreamOrder):
    """cupy's version: the worker queues on the caller's stream itself (cupy has no ``record_stream``)."""

    __slots__ = ("_stream",)

    def __init__(self, cupy: Any) -> None:  # noqa: D107 - see the class
        self._thread = threading.get_ident()
        self._stream = cupy.cuda.get_current_stream()
        self._done = None

    @contextlib.contextmanager
    def worker(self) -> Iterator[None]:
        if threading.get_ident() == self._thread:
            yield
            return
        with self._stream:
            yield

    def join(self, result: Any) -> Any:
        return result


def _side_stream(torch: Any, device: Any) -> Any:
    with _side_lock:
        stream = _side_streams.get(str(device))
        if stream is None:
            stream = _side_streams[str(device)] = torch.cuda.Stream(device=device)
        return stream


def stream_order(*values: Any) -> StreamOrder | None:
    """Return a :class:`StreamOrder` for the first CUDA array among ``values`` (None when there is none)."""
    for x in values:
        if type(x) is np.ndarray or x is None:
            continue
        if getattr(x, "is_cuda", False):
            return StreamOrder(sys.modules["torch"], x.device)
        if hasattr(x, "__cuda_array_interface__") and type(x).__module__.startswith("cupy"):
            return _CupyOrder(sys.modules["cupy"])
    return None
