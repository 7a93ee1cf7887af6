"""Compose a length-preserving transform with a codec: ``transform → codec``.

A :class:`Transform` maps a flat float32 vector to another of the same length
(a rotation, a projection with stored factors, ...) and back. ``Pipeline(t, c)``
applies ``t`` before encoding with ``c`` and ``t``'s inverse after decoding, so
the wire bytes are exactly ``c``'s. Longer chains nest: :func:`pipeline` builds
``Pipeline(t1, Pipeline(t2, codec))`` from ``pipeline(t1, t2, codec)``.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable
from typing import Any

from ..comm import arrays
from .base import Codec, CodecState, Wrapper

__all__ = ["Transform", "Pipeline", "pipeline"]


class Transform(abc.ABC):
    """Map flat float32 vectors to vectors of the same length, invertibly."""

    lossless: bool = False
    """True when inverse(forward(x)) == x exactly in float32."""

    device_capable: bool = False
    """True when forward and inverse run on torch tensors on their device (see ``Codec.device_capable``)."""

    def __init__(self) -> None:
        self.state = CodecState()

    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """Return the canonical spec of this stage (``"hadamard"``)."""

    @abc.abstractmethod
    def forward(self, x: Any, key: Hashable) -> Any:
        """Return the transformed copy of the flat float32 vector ``x``."""

    @abc.abstractmethod
    def inverse(self, y: Any, out: Any) -> Any:
        """Write the inverse transform of ``y`` into ``out`` and return ``out``."""


class Pipeline(Wrapper):
    """Apply a transform, then encode with a codec (and the reverse to decode)."""

    def __init__(self, transform: Transform, codec: Codec) -> None:
        super().__init__()
        if not isinstance(transform, Transform) or not isinstance(codec, Codec):
            raise TypeError(
                f"Pipeline(transform, codec) needs a Transform and a Codec, "
                f"got {type(transform).__name__} and {type(codec).__name__}"
            )
        self.transform = transform
        self.codec = codec
        self.state = transform.state  # the pipeline's own state is its transform's
        self.lossless = transform.lossless and codec.lossless
        # This stage's own work is the transform's; the codec's stages declare theirs.
        self.device_capable = transform.device_capable

    @property
    def spec(self) -> str:
        """Return ``"<transform>+<codec>"``."""
        return f"{self.transform.spec}+{self.codec.spec}"

    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        self.codec._encode(self.transform.forward(x, key), out, key)

    def _decode(self, buf: Any, n: int, out: Any) -> Any:
        y = self.codec._decode(buf, n, arrays.empty_f32(out, n))
        return self.transform.inverse(y, out)


def pipeline(*stages: Transform | Codec) -> Codec:
    """Chain transforms ending in a codec: ``pipeline(t1, t2, codec)``."""
    if not stages or not isinstance(stages[-1], Codec):
        raise TypeError("pipeline(*stages) needs at least one stage and a Codec last")
    result = stages[-1]
    for transform in reversed(stages[:-1]):
        result = Pipeline(transform, result)
    return result
