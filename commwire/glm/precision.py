"""Precision recipe of the GLM solvers: one dtype per rounding slot, and presets."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Precision", "PRESETS", "get_precision", "round_bf16_bits", "bf16_bits_to_float32"]

# Canonical names and the spellings accepted for them.
_ALIASES = {
    "float64": "float64", "fp64": "float64", "f64": "float64", "double": "float64",
    "float32": "float32", "fp32": "float32", "f32": "float32", "single": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
_BITS = {"float64": 64, "float32": 32, "bfloat16": 16}
_FULL = ("float64", "float32", "bfloat16")
_BLAS = ("float64", "float32")
# Slots whose arithmetic runs in BLAS or compiled scalar code take only the BLAS
# dtypes: a BF16 sum would need a rounding kernel after every add, which is what
# the paper shows to be useless (error ~ n_p * 2^-8), and MPI has no BF16 sum.
_ALLOWED = {
    "storage": _FULL,
    "gram_inputs": _FULL,
    "accumulation": _BLAS,
    "communication": _BLAS,
    "recurrence": _BLAS,
    "update": _BLAS,
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    """Choose the dtype of each rounding slot of SGD / CA-SGD."""

    storage: str = "float64"
    """Dtype X is kept in for the whole run (BF16 halves the memory traffic of the gathers)."""
    gram_inputs: str = "float64"
    """Dtype the batch rows are rounded to before the Gram and margin products."""
    accumulation: str = "float64"
    """Dtype the products accumulate in (the BLAS dtype of the panel)."""
    communication: str = "float64"
    """Dtype of the allreduce payload (margins, Gram blocks)."""
    recurrence: str = "float64"
    """Dtype of the inner recurrence: corrections, margins z_j and residuals r_j."""
    update: str = "float64"
    """Dtype of the master weights and of their update."""

    def __post_init__(self) -> None:
        for slot, allowed in _ALLOWED.items():
            value = getattr(self, slot)
            name = _ALIASES.get(str(value).lower()) if isinstance(value, str) else None
            if name is None or name not in allowed:
                raise ValueError(
                    f"Precision.{slot}={value!r} is not supported; choose one of {list(allowed)}"
                )
            object.__setattr__(self, slot, name)
        if _BITS[self.gram_inputs] > _BITS[self.accumulation]:
            raise ValueError(
                f"Precision.gram_inputs={self.gram_inputs!r} is wider than "
                f"accumulation={self.accumulation!r}: the products could not use their inputs; "
                f"narrow gram_inputs or widen accumulation"
            )

    def dtype(self, slot: str) -> np.dtype:
        """Return the numpy dtype of a BLAS-typed slot."""
        name = getattr(self, slot)
        if name == "bfloat16":
            raise ValueError(f"Precision.{slot} is bfloat16, which has no numpy dtype; it is stored as uint16 bits")
        return np.dtype(name)


PRESETS: dict[str, Precision] = {
    "fp64": Precision(),
    "fp32": Precision(storage="float32", gram_inputs="float32", accumulation="float32",
                      communication="float32", recurrence="float32", update="float32"),
    # The paper's recipe: low storage, everything that accumulates error stays FP32.
    "mixed": Precision(storage="bfloat16", gram_inputs="bfloat16", accumulation="float32",
                       communication="float32", recurrence="float32", update="float32"),
}


def get_precision(spec: str | Precision | dict[str, Any]) -> Precision:
    """Return the Precision named by a preset, given as a dict of slots, or given itself."""
    if isinstance(spec, Precision):
        return spec
    if isinstance(spec, dict):
        return Precision(**spec)
    if isinstance(spec, str) and spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    raise ValueError(
        f"precision={spec!r} is not a preset; choose one of {list(PRESETS)}, "
        f"a dict of slots or a Precision"
    )


def round_bf16_bits(x: Any, xp: Any = np) -> Any:
    """Return the BF16 bit patterns (uint16) of float x, rounded to nearest even."""
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    # Round to nearest even on the 16 dropped bits; inputs are finite (validated upstream).
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))) >> xp.uint32(16)
    return rounded.astype(xp.uint16)


def bf16_bits_to_float32(bits: Any, xp: Any = np) -> Any:
    """Return float32 values of BF16 bit patterns (exact)."""
    return (bits.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)
