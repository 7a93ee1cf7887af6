"""Lossless float32 passthrough and the fp16/bf16 cast codecs.

``none`` sends float32 bytes (4 B/element, lossless for float32 and narrower
inputs; float64 input is rounded to float32, as in every codec). ``fp16`` and
``bf16`` send 2 B/element, rounded to nearest even by the table-driven kernel;
values beyond the format's range saturate to ±max (fp16: 65504), NaN and ±Inf
stay NaN and ±Inf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

from ..comm import arrays
from .base import Codec, kernels
from .formats import get_format

__all__ = ["IdentityCodec", "CastCodec", "CastConfig"]


class IdentityCodec(Codec):
    """Send float32 values unchanged (4 bytes per element)."""

    lossless = True
    device_capable = True  # torch kernels (_torch_kernels) run on the tensor's device

    @property
    def spec(self) -> str:
        """Return ``"none"``."""
        return "none"

    def wire_nbytes(self, n: int) -> int:
        """Return ``4 * n``."""
        return 4 * int(n)

    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        kernels(arrays.kind_of(x)).put_f32(out, x)

    def _decode(self, buf: Any, n: int, out: Any) -> Any:
        kernels(arrays.kind_of(buf)).get_f32_into(buf, out)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CastConfig:
    """Settings of a 16-bit cast codec."""

    format: str = "fp16"
    """``"fp16"`` or ``"bf16"``."""

    def __post_init__(self) -> None:
        if self.format not in ("fp16", "bf16"):
            raise ValueError(f"CastConfig.format={self.format!r}; use 'fp16' or 'bf16'")


class CastCodec(Codec):
    """Cast to fp16 or bf16 on the wire (2 bytes per element, little-endian)."""

    device_capable = True  # torch kernels (_torch_kernels) run on the tensor's device

    def __init__(self, config: CastConfig | None = None, **settings: Any) -> None:
        super().__init__()
        self.config = config if config is not None else CastConfig(**settings)
        self.format = get_format(self.config.format)

    @property
    def spec(self) -> str:
        """Return ``"fp16"`` or ``"bf16"``."""
        return self.config.format

    def wire_nbytes(self, n: int) -> int:
        """Return ``2 * n``."""
        return 2 * int(n)

    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        kernels(arrays.kind_of(x)).encode16(x, out, self.format.kernel_params())

    def _decode(self, buf: Any, n: int, out: Any) -> Any:
        kernels(arrays.kind_of(buf)).decode16(buf, self.format.lut(), out)
        return out

    def _decode_add(self, buf: Any, n: int, out: Any) -> None:
        kernels(arrays.kind_of(buf)).decode16_add(buf, self.format.lut(), out)
