"""Adapt numpy arrays, torch tensors and cupy arrays to buffers MPI can move.

Every collective works on a *host view* (a numpy array sharing memory with the
input where possible) or, for CUDA buffers with a CUDA-aware MPI, on the device
array itself. One adapter per array kind turns an input into that buffer and
turns a result buffer back into the input's kind, on the input's device.

torch and cupy are imported lazily, only when such an array is passed in.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "SUPPORTED_DTYPES",
    "Adapter",
    "Invalid",
    "adapter_for",
    "check_dtype",
    "dtype_name",
    "host_view",
]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# dtypes every collective accepts (data moves: all; reductions: see commwire.comm.reduce);
# reductions of the two half types run in float32 because MPI has no 16-bit float arithmetic.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d) for d in (np.float16, BFLOAT16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
                          np.uint8, np.uint16, np.uint32, np.uint64, np.bool_)
)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
HALF_DTYPES = frozenset((np.dtype(np.float16), BFLOAT16))


def dtype_name(dtype: Any) -> str:
    """Return a short printable name for a numpy/torch/cupy dtype."""
    return str(dtype).replace("torch.", "")


def check_dtype(dtype: np.dtype) -> None:
    """Raise TypeError if ``dtype`` is not one commwire can communicate."""
    if dtype not in _SUPPORTED:
        names = ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
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
        target = self.host(out)
        if not np.shares_memory(target, host):
            np.copyto(target.reshape(host.shape), host, casting="no")
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
            return t.view(self.torch.int16).numpy().view(BFLOAT16)
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
        buf = pool.pop() if pool else self.torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        buf.copy_(t.reshape(-1))
        self._lent[buf.data_ptr()] = (key, buf)
        return buf.view(t.shape)

    def release(self, host: np.ndarray) -> None:
        entry = self._lent.pop(host.__array_interface__["data"][0], None)
        if entry is not None:
            self._pool[entry[0]].append(entry[1])

    def wrap(self, host: np.ndarray, like: Any) -> Any:
        if host.dtype == BFLOAT16:
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


def is_device_array(x: Any) -> bool:
    """Return True if ``x`` lives in GPU memory (torch CUDA tensor or cupy array)."""
    if type(x) is np.ndarray:
        return False
    if hasattr(x, "is_cuda"):
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


def host_view(x: Any) -> np.ndarray:
    """Return a contiguous numpy view (or copy) of any supported array."""
    return adapter_for(x).host(x)
