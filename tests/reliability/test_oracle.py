"""The fuzz checker itself: it fails broken results, its bounds are the formats' and not vacuous — tier 1."""

from __future__ import annotations

import numpy as np
import pytest

import _oracle as oracle
from commwire import codecs
from commwire.codecs.formats import FORMATS


def _exp(value, bound=0.1, **kw):
    return oracle.expect_from(np.asarray(value, dtype=np.float64), bound, **kw)


def test_check_compares_every_finite_element():
    exp = _exp([1.0, -2.0, 3.0], 0.1)
    assert oracle.check([1.05, -2.09, 3.0], exp) == ""
    assert "outside the bound" in oracle.check([1.0, -2.0, 3.11], exp)
    assert "non-finite where the reference is finite" in oracle.check([np.nan] * 3, exp)
    assert "shape" in oracle.check([1.0, -2.0], exp)


def test_check_compares_non_finite_positions_exactly():
    exp = _exp([np.nan, np.inf, -np.inf, 1.0], 0.0)
    assert oracle.check([np.nan, np.inf, -np.inf, 1.0], exp) == ""
    assert "not NaN" in oracle.check([np.inf, np.inf, -np.inf, 1.0], exp)
    assert "not +Inf" in oracle.check([np.nan, -np.inf, -np.inf, 1.0], exp)
    assert "finite where the result must be NaN/Inf" in oracle.check([np.nan, 1e308, -np.inf, 1.0], exp)
    lost = _exp([np.inf, 2.0], 0.0, all_nan=True)  # a format without Inf: NaN required
    assert oracle.check([np.nan, 2.0], lost) == "" and "not NaN" in oracle.check([np.inf, 2.0], lost)


def test_plain_bounds_are_a_few_ulps():
    stack = np.array([[1.0, 3.0], [2.0, -1.0], [0.5, 0.25]])
    exp = oracle.reduce_expect(stack.astype(np.float32), "sum", "float32")
    assert np.all(exp.bound < 40 * 2.0**-24 * 5) and np.all(exp.bound > 0)
    assert np.all(oracle.reduce_expect(stack, "max", "float64").bound == 0)
    assert np.all(oracle.reduce_expect(stack.astype(np.int32), "sum", "int32").bound == 0)


def test_format_table_restates_the_library_table():
    for name, fmt in oracle.FORMATS.items():
        lib = FORMATS[name]
        assert (fmt.man_bits, fmt.max_finite, fmt.min_subnormal) == (lib.man_bits, lib.max_finite, lib.min_subnormal)
        assert fmt.has_inf == (lib.inf_code is not None)


@pytest.mark.parametrize("spec, at_least", [("fp16", 0.6), ("bf16", 0.6), ("fp8-e4m3", 0.6), ("fp8-e5m2", 0.6),
                                            ("fp8-e4m3:block=32", 0.6), ("nvfp4", 0.35), ("hadamard+fp8-e4m3", 0.3)])
def test_codec_bounds_hold_and_are_nearly_reached(spec, at_least):
    # A bound far above the real error would let a wrong codec pass: the largest error
    # over a few Gaussian vectors must come close to it (and never exceed it).
    codec = codecs.get(spec)
    stages = oracle.parse_stages(spec)
    worst = 0.0
    for seed in range(4):
        x = np.random.default_rng(seed).standard_normal(4096).astype(np.float32)
        err = np.abs(codec.decode(codec.encode(x)).astype(np.float64) - x)
        worst = max(worst, float(np.max(err / oracle.codec_error(stages, np.abs(x.astype(np.float64))))))
    assert at_least < worst <= 1.0, worst


@pytest.mark.parametrize("breakage", ["nan", "off"])
@pytest.mark.parametrize("target", ["allreduce", "compressed_allreduce"])
def test_fuzz_targets_fail_on_broken_collectives(target, breakage, monkeypatch):
    # The same self-test mpi_fuzz.py runs on 3 ranks, here on one process.
    mpi_fuzz = pytest.importorskip("mpi_fuzz")
    mpi_fuzz.test_checker_catches_broken_collectives(target, breakage, monkeypatch)
