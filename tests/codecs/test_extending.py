"""The "add a codec" steps of docs/extending.md, followed literally — tier 1 here, tier 2 in mpi_extending.py.

The page's example codec (int8 values, one float32 scale per tensor) is executed
from the page itself. Reference: float64 arithmetic. Documented bound of one
round trip: |decode(encode(x)) - x| <= max|x| / 254 per element (half a step of
127 levels), plus float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
from docs_examples import run_block
from mpi_helpers import run_mpi_pytest

from commwire import codecs

torch = pytest.importorskip("torch")

PAGE = run_block("extending.md", "class TensorInt8Codec")
TensorInt8Codec = PAGE["TensorInt8Codec"]


def _bound(x: np.ndarray) -> float:
    return float(np.abs(x.astype(np.float64)).max()) / 254 * (1 + 1e-6) + 1e-30


def _data(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 3).astype(np.float32)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_round_trip_within_the_documented_bound(kind, n):
    x = _data(n, n)
    codec = codecs.get("int8-tensor")
    arg = x if kind == "numpy" else torch.from_numpy(x.copy())
    payload = codec.encode(arg)
    assert payload.nbytes == n + 4 == codec.wire_nbytes(n)
    y = codec.decode(payload)
    y = y if kind == "numpy" else y.numpy()
    err = np.abs(y.astype(np.float64) - x.astype(np.float64)).max()
    assert err <= _bound(x), (err, _bound(x))
    assert err > 0 or n == 1  # it does quantise: a codec that sent float32 would pass the bound with 0


def test_numpy_and_torch_kernels_write_the_same_bytes():
    x = _data(4096, 3)
    codec = TensorInt8Codec()
    host = codec.encode(x).data
    device = codec.encode(torch.from_numpy(x.copy())).data.numpy()
    np.testing.assert_array_equal(host, device)


def test_the_spec_composes_with_wrapper_stages():
    codec = codecs.get("ef+int8-tensor")
    assert codec.spec == "ef+int8-tensor" and codec.wire_nbytes(10) == 14
    assert type(codecs.get("int8-tensor")) is TensorInt8Codec and TensorInt8Codec.device_capable


def test_zeros_and_empty_tensors():
    codec = codecs.get("int8-tensor")
    for x in (np.zeros(5, np.float32), np.zeros(0, np.float32)):
        np.testing.assert_array_equal(codec.decode(codec.encode(x)), x)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_all_reduce_with_the_page_codec(n):
    run_mpi_pytest(n, "tests/codecs/mpi_extending.py")
