"""FP8 codecs (E4M3, E5M2) with one FP32 scale per tensor or per block.

Encoding, per tensor (``block=0``) or per block of ``block`` elements:

1. amax = largest *finite* |x|; scale = max(amax / max_finite, 2**-126) in float32
   (the floor keeps 1/scale finite for all-zero or tiny tensors);
2. code = FP8(x * (1 / scale)), saturated to ±max_finite, rounded to nearest even
   or stochastically (``rounding="sr"``, seeded, unbiased);
3. decode: x ≈ value(code) * scale.

Wire layout: n code bytes, then the scales as little-endian FP32
(4 bytes per tensor, or 4 * ceil(n / block)).

Non-finite input: NaN encodes as NaN; ±Inf encodes as ±Inf in E5M2 and as NaN in
E4M3 (which has no Inf). The scale ignores non-finite values, so every finite
element keeps its precision and every non-finite one decodes non-finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from types import ModuleType
from typing import Any

import numpy as np

from ..comm import arrays
from .base import KernelCodec, check_rounding, kernels, next_stream, rounding_options
from .formats import get_format

__all__ = ["Fp8Codec", "Fp8Config"]

_MAX_BLOCK = 2**31 - 1

SCALE_FLOOR = 2.0**-126
"""Smallest scale: the smallest normal float32, so 1/scale stays finite."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Config:
    """Settings of an FP8 codec."""

    format: str = "e4m3"
    """``"e4m3"`` (OCP fn: max 448, no Inf) or ``"e5m2"`` (max 57344, IEEE Inf/NaN)."""
    block: int = 0
    """Elements per FP32 scale; 0 means one scale for the whole tensor."""
    rounding: str = "rne"
    """``"rne"`` (round to nearest even) or ``"sr"`` (stochastic, unbiased)."""
    seed: int = 0
    """Seed of stochastic rounding; give each rank its own for independent errors."""

    def __post_init__(self) -> None:
        if self.format not in ("e4m3", "e5m2"):
            raise ValueError(f"Fp8Config.format={self.format!r}; use 'e4m3' or 'e5m2'")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or not 0 <= self.block <= _MAX_BLOCK:
            raise ValueError(f"Fp8Config.block={self.block!r}; use 0 (per tensor) or a block size from 1 to "
                             f"{_MAX_BLOCK} (2**31 - 1: the kernels index blocks with 32-bit integers)")
        check_rounding("Fp8Config", self.rounding, self.seed)


class Fp8Codec(KernelCodec):
    """Encode to FP8 codes plus FP32 scales (1 byte per element + scales)."""

    device_capable = True  # torch kernels (_torch_kernels) run on the tensor's device
    decode_kernel = "decode_blocks"

    def __init__(self, config: Fp8Config | None = None, **settings: Any) -> None:
        super().__init__()
        self.config = config if config is not None else Fp8Config(**settings)
        self.format = get_format(self.config.format)

    @property
    def spec(self) -> str:
        """Return e.g. ``"fp8-e4m3"``, ``"fp8-e4m3:block=128,sr"``."""
        c = self.config
        options = ([f"block={c.block}"] if c.block else []) + rounding_options(c.rounding, c.seed)
        return f"fp8-{c.format}" + (":" + ",".join(options) if options else "")

    def _nscales(self, n: int) -> int:
        return -(-n // self.config.block) if self.config.block else 1

    def wire_nbytes(self, n: int) -> int:
        """Return ``n + 4 * (number of scales)``."""
        return int(n) + 4 * self._nscales(int(n))

    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        k = kernels(arrays.kind_of(x))
        n = int(x.shape[0])
        fmt, c = self.format, self.config
        sr = c.rounding == "sr"
        stream = next_stream(self.state, c.seed, key) if sr else 0
        if c.block:
            scales = arrays.empty_f32(x, self._nscales(n))
            k.encode_blocks(x, out[:n], scales, c.block, fmt.kernel_params(), fmt.max_finite, SCALE_FLOOR, sr=sr, stream=stream)
        else:
            scales = k.tensor_scale(k.amax(x), fmt.max_finite, SCALE_FLOOR)
            k.encode_scaled(x, out[:n], scales, fmt.kernel_params(), sr=sr, stream=stream)
        k.put_f32(out[n:], scales)

    def _encode_feedback(self, x: Any, residual: Any, y: Any, out: Any) -> bool:
        """Encode ``y = x + residual`` into ``out``, leave ``residual = y - decoded``; False if not fused.

        Error feedback's fused path (``feedback.ErrorFeedback``): the same bits as
        encode, decode and subtract, in two passes. Per-tensor scale, round to
        nearest, numpy arrays only; anything else returns False with nothing written.
        """
        c = self.config
        if c.block or c.rounding == "sr" or not isinstance(x, np.ndarray):
            return False
        n = int(x.shape[0])
        k = kernels("numpy")
        scale = k.feedback_encode_scaled(x, residual, y, out[:n], self.format.kernel_params(), self.format.max_finite,
                                         SCALE_FLOOR)
        if scale is None:
            return False
        k.put_f32(out[n:], scale)
        return True

    def _decode_args(self, buf: Any, n: int, k: ModuleType) -> tuple:
        return buf[:n], k.get_f32(buf[n:]), self.config.block or n, self.format.lut()
