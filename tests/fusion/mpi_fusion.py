"""FusionBuffer on several ranks with numpy arrays — tier 2 (run by test_fusion.py).

Reference: a separate plain all-reduce of each tensor; fused results must be
bit-identical for float64 sums (same elements, same reduction).
"""

from __future__ import annotations

import numpy as np
import pytest

import commwire as cw
from commwire.fusion import FusionBuffer

COMM = cw.init()


def tensors(rank: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(rank)
    shapes = [(3, 4), (4,), (10, 10), (1,), (7, 3), (5,)]
    out = [(f"t{i}", rng.standard_normal(s)) for i, s in enumerate(shapes)]
    out.append(("half", rng.standard_normal(6).astype(np.float32)))  # another dtype: its own bucket
    return out


@pytest.mark.parametrize("threshold,first", [(1 << 20, 1 << 20), (200, 64), (0, 0)])
@pytest.mark.parametrize("overlap", [True, False])
def test_fused_equals_per_tensor_allreduce(threshold, first, overlap):
    named = tensors(COMM.rank)
    fb = FusionBuffer(named, op="sum", threshold_bytes=threshold, first_bucket_bytes=first, overlap=overlap)
    if threshold == 0:
        assert len(fb.buckets) == len(named)
    for name, value in reversed(named):  # any order: launches still follow bucket order
        fb.add(name, value)
    reduced = fb.wait()
    for name, value in named:
        np.testing.assert_array_equal(reduced[name], COMM.allreduce(value, "sum"))
        assert reduced[name].shape == value.shape


def test_buckets_reverse_order_dtype_and_first_bucket():
    named = tensors(0)
    fb = FusionBuffer(named, threshold_bytes=400, first_bucket_bytes=100)
    order = [n for b in fb.buckets for n in b.names]
    f64 = [n for n, v in reversed(named) if v.dtype == np.float64]
    assert [n for n in order if n != "half"] == f64
    assert all(len({named[[n for n, _ in named].index(x)][1].dtype for x in b.names}) == 1 for b in fb.buckets)
    assert fb.buckets[0].nbytes <= 100 or len(fb.buckets[0].names) == 1
    ids = [b.id for b in FusionBuffer(named, threshold_bytes=400, first_bucket_bytes=100).buckets]
    assert ids == [b.id for b in fb.buckets]  # stable across rebuilds


def test_missing_tensors_are_zero_filled_and_rounds_repeat():
    named = tensors(COMM.rank)
    fb = FusionBuffer(named, op="avg", threshold_bytes=300)
    for step in range(3):
        for name, value in named[1:]:
            fb.add(name, value * step)
        assert fb.missing() == ["t0"]
        reduced = fb.wait()
        np.testing.assert_array_equal(reduced["t0"], np.zeros((3, 4)))
        np.testing.assert_allclose(reduced["t1"], COMM.allreduce(named[1][1] * step, "avg"))


def test_errors():
    named = tensors(COMM.rank)
    with pytest.raises(ValueError, match="unique"):
        FusionBuffer(named + [named[0]])
    fb = FusionBuffer(named, threshold_bytes=0, overlap=False)
    with pytest.raises(KeyError, match="not registered"):
        fb.add("nope", np.zeros(1))
    for name, value in named:
        fb.add(name, value)
    with pytest.raises(RuntimeError, match="call wait"):
        fb.add("t0", named[0][1])
    fb.wait()


def test_compressed_buckets():
    named = [(f"w{i}", np.random.default_rng(COMM.rank * 10 + i).standard_normal(5000).astype(np.float32))
             for i in range(4)]
    fb = FusionBuffer(named, op="avg", codec="fp8-e4m3", threshold_bytes=40_000)
    for name, value in named:
        fb.add(name, value)
    reduced = fb.wait()
    for name, value in named:
        want = COMM.allreduce(value.astype(np.float64), "avg")
        assert np.linalg.norm(reduced[name] - want) / np.linalg.norm(want) < 0.06
