"""NVFP4: 4-bit E2M1 codes in 16-element blocks with E4M3 block scales and an FP32 tensor scale.

Exactly the recipe of formats.md:

1. amax = largest finite |x|; s_global = max(amax / (6 * 448), 2**-117) in float32
   (the floor keeps the smallest E4M3 scale times s_global a normal float32);
2. per 16-element block: s_block = (block_amax / 6) / s_global, stored as E4M3 (RNE);
   a non-zero block whose scale underflows to 0 gets the smallest E4M3 scale (2**-9);
3. q = E2M1(x * (1 / (e4m3(s_block) * s_global))), RNE or stochastic (``rounding="sr"``);
4. decode: x ≈ q * e4m3(s_block) * s_global.

Wire layout: ceil(n/2) bytes of packed codes (even element in the low nibble),
ceil(n/16) E4M3 scale bytes, 4 bytes FP32 s_global (little-endian):
0.5625 B/element + 4 B per tensor when n is a multiple of 16.

Non-finite input: E2M1 has no NaN or Inf, so a block that contains NaN or ±Inf
gets the E4M3 NaN as its scale and decodes to NaN in all 16 positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from types import ModuleType
from typing import Any

from ..comm import arrays
from .base import KernelCodec, check_rounding, kernels, next_stream, rounding_options
from .formats import get_format

__all__ = ["Nvfp4Codec", "Nvfp4Config"]

BLOCK = 16
"""Elements per E4M3 block scale."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Nvfp4Config:
    """Settings of the NVFP4 codec."""

    rounding: str = "rne"
    """``"rne"`` (round to nearest even) or ``"sr"`` (stochastic, unbiased) for the E2M1 codes."""
    seed: int = 0
    """Seed of stochastic rounding; give each rank its own for independent errors."""

    def __post_init__(self) -> None:
        check_rounding("Nvfp4Config", self.rounding, self.seed)


class Nvfp4Codec(KernelCodec):
    """Encode to NVFP4 (0.5625 bytes per element + 4 bytes per tensor)."""

    device_capable = True  # torch kernels (_torch_kernels) run on the tensor's device
    decode_kernel = "nvfp4_decode"

    def __init__(self, config: Nvfp4Config | None = None, **settings: Any) -> None:
        super().__init__()
        self.config = config if config is not None else Nvfp4Config(**settings)
        self.elem = get_format("e2m1")
        self.scale = get_format("e4m3")
        # 2**-126 / 2**-9: the smallest E4M3 scale times s_global stays a normal float32.
        self.global_floor = 2.0**-126 / self.scale.min_subnormal
        self.global_divisor = self.elem.max_finite * self.scale.max_finite

    @property
    def spec(self) -> str:
        """Return ``"nvfp4"`` or ``"nvfp4:sr[,seed=N]"``."""
        c = self.config
        options = rounding_options(c.rounding, c.seed)
        return "nvfp4" + (":" + ",".join(options) if options else "")

    def wire_nbytes(self, n: int) -> int:
        """Return ``ceil(n/2) + ceil(n/16) + 4``."""
        n = int(n)
        return -(-n // 2) + -(-n // BLOCK) + 4

    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        k = kernels(arrays.kind_of(x))
        n = int(x.shape[0])
        npacked, nb = -(-n // 2), -(-n // BLOCK)
        sr = self.config.rounding == "sr"
        stream = next_stream(self.state, self.config.seed, key) if sr else 0
        sg = k.tensor_scale(k.amax(x), self.global_divisor, self.global_floor)
        k.nvfp4_encode(
            x, out[:npacked], out[npacked : npacked + nb], sg,
            self.scale.kernel_params(), self.elem.kernel_params(), self.scale.lut(), sr=sr, stream=stream,
        )
        k.put_f32(out[npacked + nb :], sg)

    def _decode_args(self, buf: Any, n: int, k: ModuleType) -> tuple:
        npacked, nb = -(-n // 2), -(-n // BLOCK)
        sg = k.get_f32(buf[npacked + nb :])[0]
        return buf[:npacked], buf[npacked : npacked + nb], sg, self.scale.lut(), self.elem.lut()
