"""Stochastic rounding is unbiased and reproducible; error feedback bounds the accumulated error."""

import numpy as np
import pytest

from commwire import codecs
from commwire.codecs import _kernels, get_format

torch = pytest.importorskip("torch")

# Values between E4M3 grid points: normal range, subnormal range, negative, near max.
VALUES = np.array([1.3, 0.0041, -3.7, 201.0, 0.6, -0.00021], np.float32)


def sr_decode_mean(fmt_name, values, trials, seed):
    fmt = get_format(fmt_name)
    x = np.repeat(values, trials).astype(np.float32)
    codes = np.empty(x.size, np.uint8)
    _kernels.encode_scaled(x, codes, np.float32(1.0), fmt.kernel_params(), sr=True, stream=seed)
    return fmt.lut()[codes].reshape(values.size, trials).astype(np.float64)


@pytest.mark.parametrize("fmt_name", ["e4m3", "e5m2", "e2m1"])
def test_stochastic_rounding_is_unbiased(fmt_name):
    fmt = get_format(fmt_name)
    values = np.clip(VALUES * (fmt.max_finite / 448), -fmt.max_finite, fmt.max_finite).astype(np.float32)
    trials = 20000
    decoded = sr_decode_mean(fmt_name, values, trials, seed=12345)
    mean = decoded.mean(axis=1)
    # Each sample is lo or hi, so its standard deviation is at most (hi - lo) / 2.
    grid = np.unique(fmt.lut()[np.isfinite(fmt.lut())].astype(np.float64))
    hi = grid[np.searchsorted(grid, values, side="left")]
    lo = grid[np.searchsorted(grid, values, side="right") - 1]
    tolerance = 5 * (hi - lo) / 2 / np.sqrt(trials) + 1e-12
    assert np.all(np.abs(mean - values) <= tolerance), (mean, values, tolerance)
    # Samples only ever take the two neighbouring grid values.
    assert all(len(np.unique(row)) <= 2 for row in decoded)
    # The test can fail: round-to-nearest is biased by far more than the tolerance here.
    rne = fmt.lut()[_rne_codes(fmt, values)]
    assert np.any(np.abs(rne - values) > 10 * tolerance)


def _rne_codes(fmt, values):
    codes = np.empty(values.size, np.uint8)
    _kernels.encode_scaled(values, codes, np.float32(1.0), fmt.kernel_params())
    return codes


def test_stochastic_rounding_probability_matches_distance():
    # 1.3 lies between 1.25 and 1.375: P(up) = 0.05 / 0.125 = 0.4.
    decoded = sr_decode_mean("e4m3", np.array([1.3], np.float32), 40000, seed=7)[0]
    p_up = np.mean(decoded == 1.375)
    assert abs(p_up - (np.float32(1.3) - 1.25) / 0.125) < 5 * np.sqrt(0.24 / 40000)


def test_stochastic_rounding_reproducible_and_thread_independent():
    x = np.random.default_rng(0).standard_normal(100000).astype(np.float32)
    encodings = []
    for threads in (1, 2):
        codecs.set_threads(threads)
        try:
            encodings.append(codecs.get("nvfp4:sr,seed=9").encode(x, key="k").data)
        finally:
            codecs.set_threads(None)
    np.testing.assert_array_equal(encodings[0], encodings[1])
    codec = codecs.get("fp8-e4m3:sr")
    first, second = codec.encode(x, key="k").data, codec.encode(x, key="k").data
    assert not np.array_equal(first, second)  # the per-key counter advances the stream
    other_key = codecs.get("fp8-e4m3:sr").encode(x, key="j").data
    assert not np.array_equal(first, other_key)
    assert np.array_equal(first, codecs.get("fp8-e4m3:sr").encode(x, key="k").data)


@pytest.mark.parametrize("inner", ["fp8-e4m3", "nvfp4", "hadamard+nvfp4"])
def test_error_feedback_bounds_accumulated_error(inner):
    g = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    steps = 40

    def accumulated_error(spec):
        codec = codecs.get(spec)
        total = np.zeros_like(g, dtype=np.float64)
        errors = []
        for _ in range(steps):
            total += codec.decode(codec.encode(g, key="grad"))
            errors.append(np.linalg.norm(total - steps * 0 - g * (len(errors) + 1)))
        return np.array(errors)

    plain = accumulated_error(inner)
    fed = accumulated_error("ef+" + inner)
    # Without feedback the same rounding error repeats every step: it grows linearly.
    assert plain[-1] > 0.9 * steps * plain[0]
    # With feedback it stays bounded by about one step's error, so it shrinks relative to the sum.
    assert fed[-1] < 2 * plain[0]
    assert fed[-1] < 0.1 * plain[-1]
    assert fed[-1] / (steps * np.linalg.norm(g)) < fed[0] / np.linalg.norm(g)


def test_error_feedback_residual_rules():
    codec = codecs.get("ef+fp8-e4m3")
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    assert codec.stages[0].residual("a") is None
    codec.encode(x, key="a")
    r = codec.stages[0].residual("a")
    np.testing.assert_allclose(r, x - codecs.get("fp8-e4m3").decode(codecs.get("fp8-e4m3").encode(x)), atol=1e-7)
    with pytest.raises(ValueError, match="distinct key"):
        codec.encode(np.ones(10, np.float32), key="a")
    bad = x.copy()
    bad[5] = np.nan
    codec.encode(bad, key="a")
    assert np.all(np.isfinite(codec.stages[0].residual("a")))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_error_feedback_steps_match_a_reference(kind):
    # Residuals over several steps and keys against the definition r <- (x + r) - Q(x + r):
    # the reused scratch must not leak between keys or steps, and inputs stay untouched.
    torch = pytest.importorskip("torch")
    plain = codecs.get("fp8-e4m3")
    codec = codecs.get("ef+fp8-e4m3")
    rng = np.random.default_rng(1)
    want = {"a": np.zeros(1000, np.float32), "b": np.zeros(300, np.float32)}
    for step in range(3):
        for key, ref in want.items():
            x = rng.standard_normal(ref.size).astype(np.float32)
            before = x.copy()
            arg = x if kind == "numpy" else torch.from_numpy(x)
            got = codec.decode(codec.encode(arg, key=key))
            y = x + ref
            q = plain.decode(plain.encode(y))
            np.testing.assert_array_equal(np.asarray(got), q)  # the payload encodes x + residual
            want[key] = y - q
            np.testing.assert_array_equal(x, before)
    for key, ref in want.items():
        np.testing.assert_allclose(np.asarray(codec.stages[0].residual(key)), ref, rtol=0, atol=1e-7)
