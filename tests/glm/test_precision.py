"""Precision recipe and BF16 helpers — tier 1 (single process).

The BF16 rounding is checked bit-exactly against ml_dtypes (the reference).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commwire.glm import PRESETS, Precision, get_precision
from commwire.glm.precision import bf16_bits_to_float32, round_bf16_bits


def test_mixed_preset_is_the_papers_recipe() -> None:
    p = PRESETS["mixed"]
    assert (p.storage, p.gram_inputs) == ("bfloat16", "bfloat16")
    assert {p.accumulation, p.communication, p.recurrence, p.update} == {"float32"}


def test_aliases_normalise_and_presets_resolve() -> None:
    p = Precision(storage="bf16", gram_inputs="bf16", accumulation="fp32", communication="fp32",
                  recurrence="fp64", update="fp64")
    assert p.storage == "bfloat16" and p.accumulation == "float32" and p.recurrence == "float64"
    assert get_precision("FP32") is PRESETS["fp32"]
    assert get_precision({"storage": "float32"}).storage == "float32"
    assert p.dtype("recurrence") == np.float64


@pytest.mark.parametrize("slots, match", [
    ({"accumulation": "bfloat16"}, r"accumulation='bfloat16' is not supported"),
    ({"recurrence": "float16"}, r"recurrence='float16'"),
    ({"communication": "bf16"}, r"communication='bf16'"),
    ({"gram_inputs": "float64", "accumulation": "float32"}, r"gram_inputs='float64' is wider"),
])
def test_bad_slots_raise_naming_the_value(slots: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Precision(**slots)


def test_unknown_preset_raises() -> None:
    with pytest.raises(ValueError, match=r"precision='fp16' is not a preset"):
        get_precision("fp16")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_bf16_rounding_matches_ml_dtypes(values: list[float]) -> None:
    x = np.array(values, dtype=np.float32)
    expected = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(round_bf16_bits(x), expected)
    np.testing.assert_array_equal(bf16_bits_to_float32(expected), x.astype(ml_dtypes.bfloat16).astype(np.float32))
