"""What the GPU tier needs and whether this machine has it; imported by tests/gpu/conftest.py and its tests.

A machine without a CUDA device skips tests/gpu with the reason below. A
machine with one runs it and fails (never skips) where a piece the tier needs
is missing: torch's CUDA build, cupy for the device's CUDA, mpi4py with an MPI
library. The one optional piece is a CUDA-aware MPI: without it the direct
tier skips with its reason and the staged tier runs; ``COMMWIRE_GPU_CUDA_AWARE=1``
(set by benchmarks/gpu_check.sh when its probe passed a device buffer through
MPI) turns that skip into a failure.
"""

from __future__ import annotations

import os

import pytest

try:
    import torch
except ImportError:  # pragma: no cover - the test extra installs torch
    torch = None


def _cupy_device_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no cupy, no driver: the runtime raises instead of returning 0
        return 0


EMULATE = os.environ.get("COMMWIRE_GPU_EMULATE") == "cpu"
HAS_TORCH_CUDA = torch is not None and torch.cuda.is_available()
HAS_DEVICE = EMULATE or HAS_TORCH_CUDA or _cupy_device_count() > 0
NO_DEVICE_REASON = ("no CUDA device: torch.cuda.is_available() is False"
                    + ("" if torch is not None else " (torch is not installed)")
                    + " and cupy finds no device; tests/gpu runs on a GPU machine (benchmarks/gpu_check.sh)")


def require_torch_cuda() -> None:
    """Fail (never skip) on a GPU machine whose torch cannot use the device."""
    if not HAS_TORCH_CUDA and not EMULATE:
        pytest.fail("a CUDA device is present but torch cannot use it (a CPU build of torch?): install a CUDA "
                    "build, e.g. pip install torch --index-url https://download.pytorch.org/whl/cu130")


def require_cupy():
    """Return cupy; fail (never skip) on a GPU machine without it."""
    if EMULATE:
        pytest.skip("COMMWIRE_GPU_EMULATE=cpu: cupy arrays need a device")
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"a CUDA device is present but cupy is not usable ({exc!r}): pip install 'commwire[cuda13]' "
                    "(or [cuda12], matching the driver's CUDA)")
    return cupy


def cuda_aware() -> bool:
    """Return whether MPI takes device buffers (MPIX_Query_cuda_support, or COMMWIRE_GPU_CUDA_AWARE=1)."""
    if os.environ.get("COMMWIRE_GPU_CUDA_AWARE") == "1" or EMULATE:
        return True
    from commwire.comm.runtime import query_mpi_cuda_support

    return query_mpi_cuda_support()


def skip_unless_cuda_aware() -> None:
    """Skip the direct tier where MPI is not CUDA-aware (fail where the environment says it is)."""
    if not cuda_aware():
        if os.environ.get("COMMWIRE_GPU_CUDA_AWARE") == "0":
            pytest.skip("benchmarks/gpu_check.sh's probe found this MPI not CUDA-aware; the staged tier ran")
        pytest.skip("MPI is not CUDA-aware (MPIX_Query_cuda_support() returned 0): the direct tier needs a "
                    "CUDA-aware MPI (Open MPI/MPICH built with CUDA); the staged tier ran")


def device():
    """Return this rank's CUDA device (local rank modulo the devices: ranks may share one GPU)."""
    import commwire as cw

    if EMULATE:
        return torch.device("cpu")
    require_torch_cuda()
    index = cw.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def is_on_device(t) -> bool:
    """Return whether torch tensor ``t`` is on this tier's device (the CPU when emulated)."""
    return bool(t.is_cuda) or (EMULATE and t.device.type == "cpu")


def size(n: int) -> int:
    """Return ``n``, or a CPU-sized stand-in under the emulation."""
    return min(n, 50_000) if EMULATE else n


def require_streams() -> None:
    """Skip in the CPU emulation (CUDA streams need a device); fail on a GPU machine without torch CUDA."""
    if EMULATE:
        pytest.skip("COMMWIRE_GPU_EMULATE=cpu: CUDA streams need a device")
    require_torch_cuda()
