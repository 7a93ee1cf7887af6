"""MX (OCP Microscaling): FP8 or FP4 element codes in 32-element blocks with E8M0 power-of-two scales.

The OCP MX v1.0 conversion, as formats.md states it:

1. per 32-element block: e = floor(log2(amax)) - emax_elem, clamped to E8M0's range
   (emax_elem: 8 for E4M3, 15 for E5M2, 2 for E2M1); the scale is 2**e, stored as the
   E8M0 code e + 127;
2. q = element(x / 2**e), saturated to ±max_finite (values in [max_finite, 2**(emax+1))
   clamp, as the specification allows), rounded to nearest even or stochastically;
3. decode: x ≈ value(q) * 2**e.

There is no tensor-wide scale: a block's scale depends on that block alone, so encoding
reads the input once (NVFP4 and per-tensor FP8 first find the tensor's largest value).
The price is precision: a power-of-two scale wastes up to one binade of the element range
(formats.md: relative error 0.115 for MXFP4 against 0.095 for NVFP4 on Gaussian data).

Wire layout: the element codes (one byte each for MXFP8; for MXFP4 two per byte, even
element in the low nibble), then ceil(n/32) E8M0 scale bytes: MXFP8 1.03125 and MXFP4
0.53125 bytes per element when n is a multiple of 32.

Non-finite input: a block holding NaN or ±Inf gets the E8M0 NaN scale (0xFF) and decodes
to NaN in all 32 positions (the OCP rule: a NaN scale makes every element NaN). Other
blocks are unaffected. floor(log2) is taken from the float32 exponent field, so zero and
float32-subnormal blocks get the smallest scale, 2**-127.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from types import ModuleType
from typing import Any

from ..comm import arrays
from .base import KernelCodec, check_rounding, kernels, next_stream, rounding_options
from .formats import get_format

__all__ = ["MxCodec", "MxConfig", "MX_NAMES"]

BLOCK = 32
"""Elements per E8M0 scale (OCP MX)."""

MX_NAMES = {"e4m3": "mxfp8-e4m3", "e5m2": "mxfp8-e5m2", "e2m1": "mxfp4"}
"""Spec name of each element format."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MxConfig:
    """Settings of an MX codec."""

    element: str = "e4m3"
    """Element format: ``"e4m3"`` or ``"e5m2"`` (MXFP8) or ``"e2m1"`` (MXFP4)."""
    rounding: str = "rne"
    """``"rne"`` (round to nearest even) or ``"sr"`` (stochastic, unbiased) for the element codes."""
    seed: int = 0
    """Seed of stochastic rounding; give each rank its own for independent errors."""

    def __post_init__(self) -> None:
        if self.element not in MX_NAMES:
            raise ValueError(f"MxConfig.element={self.element!r}; use one of {', '.join(map(repr, MX_NAMES))}")
        check_rounding("MxConfig", self.rounding, self.seed)


class MxCodec(KernelCodec):
    """Encode to MXFP8 (1.03125 bytes per element) or MXFP4 (0.53125 bytes per element)."""

    device_capable = True  # torch kernels (_torch_kernels) run on the tensor's device
    decode_kernel = "mx_decode"

    def __init__(self, config: MxConfig | None = None, **settings: Any) -> None:
        super().__init__()
        self.config = config if config is not None else MxConfig(**settings)
        self.elem = get_format(self.config.element)
        self.scale = get_format("e8m0")
        self.emax = math.frexp(self.elem.max_finite)[1] - 1  # floor(log2(max_finite)): 8, 15, 2
        self.packed = self.elem.bits == 4

    @property
    def spec(self) -> str:
        """Return e.g. ``"mxfp8-e4m3"``, ``"mxfp4"``, ``"mxfp4:sr,seed=3"``."""
        c = self.config
        options = rounding_options(c.rounding, c.seed)
        return MX_NAMES[c.element] + (":" + ",".join(options) if options else "")

    def _ncodes(self, n: int) -> int:
        return -(-n // 2) if self.packed else n

    def wire_nbytes(self, n: int) -> int:
        """Return ``n + ceil(n/32)`` (MXFP8) or ``ceil(n/2) + ceil(n/32)`` (MXFP4)."""
        n = int(n)
        return self._ncodes(n) + -(-n // BLOCK)

    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        k = kernels(arrays.kind_of(x))
        n = int(x.shape[0])
        nc = self._ncodes(n)
        sr = self.config.rounding == "sr"
        stream = next_stream(self.state, self.config.seed, key) if sr else 0
        k.mx_encode(x, out[:nc], out[nc:], self.elem.kernel_params(), self.emax, self.packed, sr=sr, stream=stream)

    def _decode_args(self, buf: Any, n: int, k: ModuleType) -> tuple:
        nc = self._ncodes(n)
        return buf[:nc], buf[nc:], self.scale.lut(), self.elem.lut(), self.packed
