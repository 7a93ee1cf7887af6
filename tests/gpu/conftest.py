"""The GPU tier — tier 3: CUDA devices, one or more ranks per GPU.

Tiers of commwire's tests (each module states its own):
1. single process, no devices (``python -m pytest``);
2. real MPI jobs on the CPU (``mpiexec -n 1..4``), device paths included:
   torch CPU tensors stand in for CUDA ones (tests/core/mpi_device.py);
3. this folder, on a CUDA device: collectives × dtypes × {CUDA-aware, staged}
   on torch CUDA tensors and cupy arrays, codec kernels bit-exact against the
   CPU ones, the compressed all-reduce, DistributedOptimizer against
   single-process training, GLM solvers on cupy. Run it as
   ``python -m pytest tests/gpu`` and ``mpiexec -n 2 python -m pytest -p
   no:cacheprovider -o addopts= tests/gpu`` (two ranks may share one GPU);
   benchmarks/gpu_check.sh does both on a fresh GPU machine.

Without a CUDA device every test here is collected and skipped with the reason
(``pytest tests/gpu -rs`` shows it); with one, nothing is skipped for a
missing piece: a missing CUDA torch or cupy fails (see _gpu.py). Only the
direct tier skips, where MPI is not CUDA-aware, saying so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent, HERE.parent / "glm"):  # _gpu (here), mpi_helpers, the GLM tests' _reference
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _gpu import EMULATE, HAS_DEVICE, NO_DEVICE_REASON  # noqa: E402


@pytest.fixture(autouse=True)
def _emulated_device():
    """Under COMMWIRE_GPU_EMULATE=cpu, torch CPU tensors take the device paths (see _gpu.py)."""
    if not EMULATE:
        yield
        return
    from commwire.comm.arrays import cpu_standin

    with cpu_standin():
        yield


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.gpu)
            if not HAS_DEVICE:
                item.add_marker(pytest.mark.skip(reason=NO_DEVICE_REASON))
