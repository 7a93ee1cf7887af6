"""commwire._validate.positive_int: the one positive-integer check — tier 1 (single process)."""

from __future__ import annotations

import numpy as np
import pytest

from commwire._validate import positive_int


@pytest.mark.parametrize("value", [1, 7, 2**40, np.int64(3), np.int32(1), np.uint8(200)])
def test_positive_integers_pass_through_unchanged(value):
    assert positive_int("n", value) is value


def test_none_passes_only_when_allowed():
    assert positive_int("n", None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"^n=None must be a positive integer$"):
        positive_int("n", None)


@pytest.mark.parametrize("value", [True, False, 2.0, 1.5, "3", 0, -1, np.int64(0), np.float32(4), [1]])
def test_everything_else_is_refused_naming_the_argument_and_value(value):
    with pytest.raises(ValueError) as info:
        positive_int("batch_size", value)
    assert str(info.value) == f"batch_size={value!r} must be a positive integer"


def test_the_message_names_the_other_accepted_values():
    with pytest.raises(ValueError, match=r"^s=0 must be a positive integer or 'auto'$"):
        positive_int("s", 0, extra="or 'auto'")
    with pytest.raises(ValueError, match=r"^max_steps=-2 must be a positive integer or None$"):
        positive_int("max_steps", -2, allow_none=True)
