"""Sign codec: one bit per element and one FP32 scale per block, for 1-bit training with error feedback.

Per block of ``block`` elements (a multiple of 8): scale = mean |x| (summed in float64,
rounded to float32), bit = 1 where x < 0; decode: x ≈ ±scale. This is the compressor of
EF-signSGD (Karimireddy et al., 2019, "Error Feedback Fixes SignSGD") and of 1-bit Adam's
compressed momentum (DeepSpeed): on its own it is biased and coarse (relative error
sqrt(1 - 2/π) ≈ 0.60 on Gaussian data), so use it as ``ef+sign``, which carries each
step's error into the next.

Wire layout: ceil(n / 8) bytes of bits (bit k of byte j is element 8j + k), then
ceil(n / block) little-endian FP32 scales: 0.125 + 4 / block bytes per element (0.15625,
25.6x fewer than FP32, at the default 128).

Non-finite input: a block holding NaN or ±Inf gets a NaN scale and decodes to NaN in all
its positions. Zeros decode to +scale (the sign has no zero); an all-zero block to zeros.
The torch kernels sum a block in another order than the CPU ones: for a block whose values
span more than about 22 binades the float64 sum can differ, and so the scale in its last bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from types import ModuleType
from typing import Any

from ..comm import arrays
from .base import KernelCodec, kernels

__all__ = ["SignCodec", "SignConfig"]

_MAX_BLOCK = 2**31 - 8


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SignConfig:
    """Settings of the sign codec."""

    block: int = 128
    """Elements per FP32 scale: a multiple of 8 (whole bytes of bits)."""

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or not 8 <= self.block <= _MAX_BLOCK \
                or self.block % 8:
            raise ValueError(f"SignConfig.block={self.block!r}; use a multiple of 8 from 8 to {_MAX_BLOCK} "
                             "(a block is whole bytes of sign bits), e.g. sign:block=128")


class SignCodec(KernelCodec):
    """Encode to sign bits plus FP32 block scales (0.125 + 4/block bytes per element)."""

    device_capable = True  # torch kernels (_torch_kernels) run on the tensor's device
    decode_kernel = "sign_decode"

    def __init__(self, config: SignConfig | None = None, **settings: Any) -> None:
        super().__init__()
        self.config = config if config is not None else SignConfig(**settings)
        self.block = self.config.block

    @property
    def spec(self) -> str:
        """Return ``"sign"`` or ``"sign:block=N"``."""
        return "sign" if self.block == 128 else f"sign:block={self.block}"

    def wire_nbytes(self, n: int) -> int:
        """Return ``ceil(n / 8) + 4 * ceil(n / block)``."""
        n = int(n)
        return -(-n // 8) + 4 * -(-n // self.block)

    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        k = kernels(arrays.kind_of(x))
        n = int(x.shape[0])
        nbits = -(-n // 8)
        scales = arrays.empty_f32(x, -(-n // self.block))
        k.sign_encode(x, out[:nbits], scales, self.block)
        k.put_f32(out[nbits:], scales)

    def _decode_args(self, buf: Any, n: int, k: ModuleType) -> tuple:
        nbits = -(-n // 8)
        return buf[:nbits], k.get_f32(buf[nbits:]), self.block
