"""Adapt numpy arrays, torch tensors and cupy arrays to the codec kernels.

Each array kind maps to one kernel module with the same function names:
numpy → ``_kernels`` (numba), torch (CPU or CUDA) → ``_torch_kernels``. cupy
arrays are viewed as torch tensors through DLPack (zero copy) and results are
viewed back, so cupy needs no kernels of its own. torch and cupy are imported
only when such an array is seen.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


def kind_of(x: Any) -> str:
    """Return ``"numpy"``, ``"torch"`` or ``"cupy"`` for an array, else raise TypeError."""
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return "torch"
    if module == "cupy":
        return "cupy"
    raise TypeError(
        f"codecs encode numpy arrays, torch tensors or cupy arrays, got {type(x).__name__}; "
        "convert with numpy.asarray(x)"
    )


_dtype_names: dict[Any, str] = {}


def dtype_name(x: Any) -> str:
    """Return the element type's short name (``"float32"``, ``"bfloat16"``, ``"int64"``)."""
    # str() of a dtype takes microseconds, as long as a small codec kernel: cache it per dtype.
    dtype = x.dtype
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).replace("torch.", "")
    return name


def check_float(x: Any, spec: str) -> None:
    """Raise TypeError unless ``x`` holds float16/bfloat16/float32/float64 values."""
    name = dtype_name(x)
    if name not in _FLOAT_NAMES:
        raise TypeError(
            f"codec {spec!r} encodes floating-point arrays ({', '.join(_FLOAT_NAMES)}), got {name}; "
            "cast first (x.astype(numpy.float32)) or send integer/boolean data without a codec"
        )


_kernel_modules: dict[str, ModuleType] = {}


def kernels(kind: str) -> ModuleType:
    """Return the kernel module for an array kind (cupy runs through torch)."""
    module = _kernel_modules.get(kind)  # every codec call asks: skip the import machinery
    if module is None:
        if kind == "numpy":
            from . import _kernels as module
        else:
            from . import _torch_kernels as module
        _kernel_modules[kind] = module
    return module


def _torch():
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
    """Return a contiguous 1-D float32 copy or view of ``x`` (numpy or torch)."""
    if kind == "numpy":
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    torch = _torch()
    return to_torch(x).reshape(-1).to(torch.float32).contiguous()


def empty_u8(like: Any, nbytes: int) -> Any:
    """Allocate an uninitialised uint8 buffer on the same device as ``like``."""
    if isinstance(like, np.ndarray):
        return np.empty(nbytes, np.uint8)
    torch = _torch()
    return torch.empty(nbytes, dtype=torch.uint8, device=like.device)


def empty_f32(like: Any, n: int) -> Any:
    """Allocate an uninitialised float32 vector on the same device as ``like``."""
    if isinstance(like, np.ndarray):
        return np.empty(n, np.float32)
    torch = _torch()
    return torch.empty(n, dtype=torch.float32, device=like.device)


def restore(flat: Any, shape: tuple, dtype: str, kind: str, out: Any = None) -> Any:
    """Reshape a decoded float32 vector and cast it to ``dtype``, into ``out`` if given."""
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


def _ml_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))
