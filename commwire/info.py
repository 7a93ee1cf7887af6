"""Collect what ``commwire info`` reports about the environment."""

from __future__ import annotations

import importlib
import platform
import sys
from typing import Any

__all__ = ["collect", "format_info"]


def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # noqa: BLE001 - report any broken optional install as missing
        return None


def _devices() -> dict[str, Any]:
    out: dict[str, Any] = {"torch_cuda": None, "cupy_devices": None}
    if _version("torch"):
        import torch

        out["torch_cuda"] = (
            [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available()
            else []
        )
    if _version("cupy"):
        import cupy

        try:
            out["cupy_devices"] = cupy.cuda.runtime.getDeviceCount()
        except Exception:  # noqa: BLE001 - cupy without a driver
            out["cupy_devices"] = 0
    return out


def collect() -> dict[str, Any]:
    """Return versions, MPI vendor/library, thread level, CUDA support and devices."""
    from . import __version__
    from .comm import runtime
    from .launch import find_launcher

    comm = runtime.init()
    from mpi4py import MPI

    try:
        launcher = find_launcher()
        launcher_text = f"{launcher.kind} ({launcher.path})"
    except RuntimeError as exc:
        launcher_text = f"none: {exc}"
    library = MPI.Get_library_version().strip().splitlines()
    return {
        "commwire": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "numpy": _version("numpy"),
        "mpi4py": _version("mpi4py"),
        "ml_dtypes": _version("ml_dtypes"),
        "numba": _version("numba"),
        "torch": _version("torch"),
        "cupy": _version("cupy"),
        "mpi_vendor": MPI.get_vendor()[0] + " " + ".".join(map(str, MPI.get_vendor()[1])),
        "mpi_library": library[0] if library else "",
        "mpi_standard": ".".join(map(str, MPI.Get_version())),
        "thread_level": runtime.thread_level(),
        "cuda_aware_mpi": runtime.query_mpi_cuda_support(),
        "cuda_buffers": "direct to MPI" if comm.cuda_aware else "staged through host memory",
        "launcher": launcher_text,
        "world_size": comm.size,
        **_devices(),
    }


def format_info(info: dict[str, Any]) -> str:
    """Render ``collect()``'s dict as aligned ``key: value`` lines."""
    width = max(map(len, info))
    return "\n".join(f"{key.ljust(width)} : {'-' if value is None else value}" for key, value in info.items())
