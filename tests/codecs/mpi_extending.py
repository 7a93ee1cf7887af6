"""The page's int8 codec in compressed all-reduces on several ranks: host and device paths — tier 2.

Run by test_extending.py under mpiexec. Reference: the float64 sum of every
rank's input. Bound per element: each rank's contribution is quantised once
(<= max|x_r| / 254) and the reduced chunk once more (<= max|sum| / 254), since
every encoded segment's scale is at most the whole tensor's. The device path
runs on torch CPU tensors standing in for CUDA ones (``arrays.cpu_standin``).
"""

from __future__ import annotations

import numpy as np
import pytest
from docs_examples import run_block

import commwire as cw
from commwire.codecs.collective import device_space
from commwire.comm import arrays

torch = pytest.importorskip("torch")

COMM = cw.init()
TensorInt8Codec = run_block("extending.md", "class TensorInt8Codec")["TensorInt8Codec"]


def _inputs(n: int) -> list[np.ndarray]:
    return [(np.random.default_rng(r).standard_normal(n) * (r + 1)).astype(np.float32) for r in range(COMM.size)]


def _check(result: np.ndarray, inputs: list[np.ndarray]) -> None:
    want = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    bound = (sum(np.abs(x).max() for x in inputs) + np.abs(want).max()) / 254 * (1 + 1e-5)
    err = np.abs(result.astype(np.float64) - want).max()
    assert err <= bound, (err, bound)
    assert err > 0  # quantised, not sent as float32
    digests = COMM.allgather_object(result.tobytes())
    assert all(d == digests[0] for d in digests)  # every rank ends with the same bits


@pytest.mark.parametrize("n", [1000, 300_001])
def test_host_path(n):
    inputs = _inputs(n)
    _check(cw.allreduce(inputs[COMM.rank], codec="int8-tensor", name=f"page-int8-tensor-host-{n}"), inputs)


@pytest.mark.parametrize("n", [1000, 300_001])
def test_device_path(n):
    inputs = _inputs(n)
    x = torch.from_numpy(inputs[COMM.rank].copy())
    with arrays.cpu_standin():
        assert device_space(COMM, TensorInt8Codec(), x) is not None  # the codec's own declaration puts it on the device
        y = cw.allreduce(x, codec="int8-tensor", name=f"page-int8-tensor-device-{n}")
    assert isinstance(y, torch.Tensor)
    _check(y.numpy(), inputs)
