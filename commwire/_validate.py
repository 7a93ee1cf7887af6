"""Argument checks shared by every layer: one implementation, one message shape."""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["positive_int"]


def positive_int(name: str, value: Any, *, allow_none: bool = False, extra: str = "") -> Any:
    """Return ``value`` if it is an int >= 1 (numpy integers included, bool excluded), else raise ValueError.

    ``name`` is the argument as the caller wrote it; ``extra`` names further accepted
    values for the message (e.g. ``"or 'auto'"``). With ``allow_none``, ``None`` passes.
    """
    if value is None and allow_none:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        accepted = "a positive integer" + (" or None" if allow_none else "") + (f" {extra}" if extra else "")
        raise ValueError(f"{name}={value!r} must be {accepted}")
    return value
