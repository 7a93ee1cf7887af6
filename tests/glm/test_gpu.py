"""GLM solvers on CuPy arrays — tier 3 (GPU); skips cleanly without CuPy or a CUDA device.

The array-module path runs on the device and must match the numpy path: FP64
to 1e-10 relative, mixed precision (BF16 storage as uint16 bits) to 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest

import commwire as cw
from commwire import glm
from _reference import LOSSES, make_data, rel

cupy = pytest.importorskip("cupy")
try:
    HAS_DEVICE = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no driver: the runtime raises instead of returning 0
    HAS_DEVICE = False
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_DEVICE, reason="no CUDA device")]
COMM = cw.init()


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("precision, tol", [("fp64", 1e-10), ("mixed", 1e-4)])
def test_cupy_matches_numpy(loss: str, precision: str, tol: float) -> None:
    X, y = make_data(loss)
    common = dict(loss=loss, s=4, batch_size=8, lr=0.05, l2=0.01, max_steps=75, tol=None, precision=precision,
                  comm=COMM)
    host = glm.solve(glm.from_array(X, y, comm=COMM), **common)
    device = glm.solve(glm.from_array(cupy.asarray(X), cupy.asarray(y), comm=COMM), **common)
    assert isinstance(device.coef, np.ndarray)
    assert rel(device.coef, host.coef) < tol


def test_auto_s_on_the_device_keeps_the_host_iterates() -> None:
    X, y = make_data("logistic")
    common = dict(loss="logistic", batch_size=8, lr=0.05, max_steps=75, tol=None, comm=COMM)
    device = glm.solve(glm.from_array(cupy.asarray(X), cupy.asarray(y), comm=COMM), s="auto", **common)
    assert device.s == device.auto.s in device.auto.candidates
    host = glm.solve(glm.from_array(X, y, comm=COMM), s=device.s, **common)
    assert rel(device.coef, host.coef) < 1e-10


def test_numba_kernels_refuse_device_arrays() -> None:
    X, y = make_data("logistic")
    with pytest.raises(ValueError, match=r"kernels='numba' runs on numpy arrays only"):
        glm.solve(glm.from_array(cupy.asarray(X), cupy.asarray(y), comm=COMM), loss="logistic",
                  kernels="numba", max_steps=2, comm=COMM)
