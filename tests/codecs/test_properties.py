"""Property-based tests over shapes, layouts and values (hypothesis)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from commwire import codecs

SPECS = ["none", "fp16", "bf16", "fp8-e4m3", "fp8-e5m2", "fp8-e4m3:block=5", "nvfp4", "nvfp4:sr",
         "hadamard:size=4+fp8-e4m3", "ef+nvfp4", "mxfp8-e4m3", "mxfp4", "int8", "int4:block=6", "sign:block=8"]
# Largest |error| / block amax each codec allows on finite data.
TOLERANCE = {"none": 0.0, "fp16": 1e-3, "bf16": 1e-2, "fp8-e4m3": 0.07, "fp8-e5m2": 0.13,
             "fp8-e4m3:block=5": 0.07, "nvfp4": 0.26, "nvfp4:sr": 0.5, "hadamard:size=4+fp8-e4m3": 0.2,
             "ef+nvfp4": 0.26,
             # MX: amax / scale lies in [2**emax, 2**(emax+1)) and saturates at max_finite (448 of 512, 6 of 8).
             "mxfp8-e4m3": 0.125, "mxfp4": 0.25,
             # integers: half a step, amax / (2 * qmax)
             "int8": 0.5 / 127 * 1.001, "int4:block=6": 0.5 / 7 * 1.001,
             # sign: |x -/+ mean|x|| <= amax
             "sign:block=8": 1.0 + 1e-6}

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40)
finite = st.floats(-1e6, 1e6, width=32, allow_subnormal=True)
anything = st.floats(width=32, allow_nan=True, allow_infinity=True)


def arrays(elements):
    return shapes.flatmap(lambda s: hnp.arrays(np.float32, s, elements=elements))


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=arrays(finite), transpose=st.booleans())
def test_round_trip_shapes_and_error(spec, x, transpose):
    if transpose and x.ndim >= 2:
        x = x.T  # non-contiguous input
    codec = codecs.get(spec)
    payload = codec.encode(x)
    assert payload.nbytes == codec.wire_nbytes(x.size)
    y = codec.decode(payload)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.size:
        amax = float(np.max(np.abs(x)))
        assert np.all(np.isfinite(y))
        # fp16 saturates beyond its range (±65504), as documented.
        expected = np.clip(x, -65504, 65504) if spec == "fp16" else x
        # fp16 has no scale: its subnormals are 2**-24 apart, so absolute error up to 2**-25.
        absolute = 2.0**-25 if spec == "fp16" else 1e-30
        assert np.max(np.abs(y.astype(np.float64) - expected)) <= TOLERANCE[spec] * amax + absolute


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=30, deadline=None, database=None)
@given(x=arrays(anything))
def test_non_finite_positions_decode_non_finite(spec, x):
    codec = codecs.get(spec)
    y = codec.decode(codec.encode(x))
    assert not np.isfinite(y[~np.isfinite(x)]).any()


@settings(max_examples=30, deadline=None, database=None)
@given(n=st.integers(0, 300), block=st.integers(1, 64))
def test_truncated_buffers_always_raise(n, block):
    for codec in (codecs.get("nvfp4"), codecs.get(f"fp8-e5m2:block={block}")):
        buf = np.zeros(codec.wire_nbytes(n), np.uint8)
        codec.decode_from(buf, n)
        if buf.size == 0:  # per-block FP8 of 0 elements is 0 bytes: nothing to truncate
            continue
        with pytest.raises(ValueError, match="wire_nbytes"):
            codec.decode_from(buf[:-1], n)
