"""Bit-exactness of the table-driven kernels against ml_dtypes (tier: single process, CPU).

Both backends (numba for numpy, torch ops for torch tensors) are checked on the
same inputs. ml_dtypes' casts to "fn" types overflow to NaN, so finite inputs
are clipped to ±max before the reference cast; saturation is checked separately.
"""

import ml_dtypes
import numpy as np
import pytest

from commwire.codecs import FORMATS, get_format
from commwire.codecs import _kernels

torch = pytest.importorskip("torch")
from commwire.codecs import _torch_kernels  # noqa: E402

ENCODED = ["e4m3", "e5m2", "e2m1", "fp16", "bf16"]
BACKENDS = ["numba", "torch"]


def encode(fmt, x, backend):
    """Return the codes of float32 ``x`` (scale 1) as uint8/uint16."""
    x = np.ascontiguousarray(x, np.float32)
    p = fmt.kernel_params()
    if backend == "numba":
        k, xs = _kernels, x
        out = np.empty(x.size * (2 if fmt.bits > 8 else 1), np.uint8)
    else:
        k, xs = _torch_kernels, torch.from_numpy(x)
        out = torch.empty(x.size * (2 if fmt.bits > 8 else 1), dtype=torch.uint8)
    if fmt.bits > 8:
        k.encode16(xs, out, p)
    else:
        k.encode_scaled(xs, out, np.float32(1.0) if backend == "numba" else torch.tensor(1.0), p)
    out = out if backend == "numba" else out.numpy()
    return out.view("<u2") if fmt.bits > 8 else out


def reference(fmt, x):
    """Return ml_dtypes' codes of ``x`` clipped to ±max (RNE)."""
    clipped = np.clip(np.asarray(x, np.float32), -fmt.max_finite, fmt.max_finite)
    codes = clipped.astype(fmt.ml_dtype())
    return codes.view(np.uint16) if fmt.bits > 8 else codes.view(np.uint8)


def edge_values(fmt):
    """Return ±0, subnormals, ties, max, just above max and neighbours, for ``fmt``."""
    lut = fmt.lut().astype(np.float64)
    finite = np.unique(np.abs(lut[np.isfinite(lut)]))
    mids = (finite[:-1] + finite[1:]) / 2  # exact halfway ties (RNE decides)
    eps = np.float32(2.0**-20)
    vals = np.concatenate([
        finite, mids, mids * (1 + eps), mids * (1 - eps),
        [fmt.min_subnormal / 2, fmt.min_subnormal / 2 * 1.01, fmt.min_subnormal / 4, 1e-45],
        [fmt.max_finite, fmt.max_finite * 1.01, fmt.max_finite * 1.5, fmt.max_finite * 4, 3e38],
    ])
    if fmt.bits > 8:  # fp16/bf16: sample the table instead of all 65536 codes
        vals = vals[:: max(1, vals.size // 4096)]
    vals = vals.astype(np.float32)
    return np.concatenate([vals, -vals, np.array([0.0, -0.0], np.float32)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ENCODED)
def test_edge_cases_bit_exact(name, backend):
    fmt = get_format(name)
    x = edge_values(fmt)
    np.testing.assert_array_equal(encode(fmt, x, backend), reference(fmt, x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ENCODED)
def test_random_bit_patterns_bit_exact(name, backend):
    fmt = get_format(name)
    rng = np.random.default_rng(1)
    # Uniform random bit patterns cover every exponent, subnormals included;
    # plus values scaled into the format's own range.
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ranged = (rng.standard_normal(20000) * fmt.max_finite / 8).astype(np.float32)
    x = np.concatenate([bits[np.isfinite(bits)], ranged])
    np.testing.assert_array_equal(encode(fmt, x, backend), reference(fmt, x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ENCODED)
def test_saturation_and_specials(name, backend):
    fmt = get_format(name)
    above = min(fmt.max_finite * 2, float(np.finfo(np.float32).max))  # finite in float32 even for bf16
    x = np.array([above, -above, np.inf, -np.inf, np.nan, -np.nan], np.float32)
    codes = encode(fmt, x, backend).astype(np.int64)
    assert codes[0] == fmt.max_code and codes[1] == fmt.max_code | fmt.sign_mask
    decoded = fmt.lut()[codes]
    if fmt.inf_code is not None:
        assert decoded[2] == np.inf and decoded[3] == -np.inf
    elif fmt.nan_code is not None:  # E4M3: Inf becomes NaN, never a finite number
        assert np.isnan(decoded[2]) and np.isnan(decoded[3])
    else:  # E2M1 has neither: Inf saturates like ml_dtypes; NVFP4 marks such blocks via the scale
        assert decoded[2] == fmt.max_finite and decoded[3] == -fmt.max_finite
        np.testing.assert_array_equal(codes[2:4], reference(fmt, x[2:4]))
    if fmt.nan_code is not None:
        assert np.isnan(decoded[4]) and np.isnan(decoded[5])
        np.testing.assert_array_equal(codes[4:], reference(fmt, x[4:]))  # same NaN codes as ml_dtypes


@pytest.mark.parametrize("name", list(FORMATS))
def test_table_matches_ml_dtypes(name):
    fmt = get_format(name)
    info = ml_dtypes.finfo(fmt.ml_dtype()) if fmt.bits <= 8 or name == "bf16" else np.finfo(np.float16)
    assert fmt.max_finite == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    codes = np.arange(1 << fmt.bits, dtype=np.uint16 if fmt.bits > 8 else np.uint8)
    ref = codes.view(fmt.ml_dtype()).astype(np.float32)
    lut = fmt.lut()
    np.testing.assert_array_equal(np.isnan(lut), np.isnan(ref))
    finite = ~np.isnan(ref)
    np.testing.assert_array_equal(lut[finite].view(np.uint32), ref[finite].view(np.uint32))


def test_documented_constants():
    assert get_format("e4m3").max_finite == 448 and get_format("e4m3").nan_code == 0x7F
    assert get_format("e5m2").max_finite == 57344 and get_format("e5m2").inf_code == 0x7C
    assert sorted(np.abs(get_format("e2m1").lut()).tolist())[::2] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert get_format("e8m0").lut()[127] == 1.0 and np.isnan(get_format("e8m0").lut()[255])
    with pytest.raises(ValueError, match="valid"):
        get_format("e3m4")
    with pytest.raises(ValueError, match="decode-only"):
        get_format("e8m0").kernel_params()
