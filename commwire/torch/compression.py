"""Horovod's Compressor objects, and commwire's codecs as Compressors.

Horovod's interface is two functions: ``compress(tensor) -> (tensor, ctx)``
before the all-reduce and ``decompress(tensor, ctx) -> tensor`` after it. A
user-written Compressor with those two methods works wherever Horovod takes
one (``hvd.allreduce(compression=...)``, ``DistributedOptimizer``).

Quantising codecs (FP8, NVFP4, error feedback) cannot work that way: MPI
cannot add encoded payloads. ``CodecCompressor`` therefore carries a commwire
codec spec, and commwire's collectives run the compressed all-reduce of
commwire.codecs (encode, exchange, reduce in FP32, re-encode, gather) for it;
its ``compress``/``decompress`` pass tensors through unchanged, since the
encoding happens on the wire.

Example:
    >>> opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp8)
    >>> hvd.allreduce(t, compression=hvd.Compression.fp16)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "CodecCompressor", "Compression", "resolve"]


class Compressor:
    """Interface: compress a tensor before the all-reduce, decompress the result after it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and the context ``decompress`` needs."""
        raise NotImplementedError("a Compressor implements compress(tensor) -> (tensor, ctx)")

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the tensor rebuilt from the reduced ``tensor`` and ``ctx``."""
        raise NotImplementedError("a Compressor implements decompress(tensor, ctx) -> tensor")


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return ``tensor`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return ``tensor`` unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 (others unchanged), as Horovod does."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Cast a floating-point ``tensor`` to float16; return it with its original dtype."""
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Cast back to the dtype ``compress`` saw."""
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class CodecCompressor(Compressor):
    """A commwire codec (``"fp8-e4m3"``, ``"ef+nvfp4"``, …) that commwire's collectives run on the wire.

    Args:
        spec: a ``commwire.codecs`` spec string (checked now). Each
            DistributedOptimizer builds its own codec from it, so error-feedback
            state is never shared between optimizers.
    """

    def __init__(self, spec: str) -> None:
        from ..codecs import get

        get(spec)  # a bad spec fails here, not at the first step
        self.spec = spec

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        """Return ``tensor`` unchanged: the codec encodes inside the collective."""
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        """Return ``tensor`` unchanged: the collective decoded it."""
        return tensor

    def __repr__(self) -> str:
        return f"CodecCompressor({self.spec!r})"


class Compression:
    """Gradient compressions: Horovod's (``none``, ``fp16``) and commwire's codecs.

    ``fp8`` / ``nvfp4`` quantise with one scale per chunk (per 16 elements for
    NVFP4); ``mxfp8`` / ``mxfp4`` with one power-of-two scale per 32 elements (OCP
    MX); ``int8`` / ``int4`` with one FP32 scale per 128 / 32 elements; ``sign_ef``
    one bit per element with error feedback (EF-signSGD); the ``*_ef``
    variants add error feedback, which carries each step's
    quantisation error into the next step. Any ``commwire.codecs`` spec string
    is accepted wherever a Compression member is.
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = CodecCompressor("bf16")
    fp8 = CodecCompressor("fp8-e4m3")
    fp8_e5m2 = CodecCompressor("fp8-e5m2")
    fp8_ef = CodecCompressor("ef+fp8-e4m3")
    nvfp4 = CodecCompressor("nvfp4")
    nvfp4_ef = CodecCompressor("ef+nvfp4")
    mxfp8 = CodecCompressor("mxfp8-e4m3")
    mxfp4 = CodecCompressor("mxfp4")
    mxfp4_ef = CodecCompressor("ef+mxfp4")
    int8 = CodecCompressor("int8")
    int4 = CodecCompressor("int4")
    int4_ef = CodecCompressor("ef+int4")
    sign_ef = CodecCompressor("ef+sign")
    gift_fp8 = "gift+fp8-e4m3"  # GIFT transform (commwire.torch.gift): needs DistributedOptimizer(model=...)
    gift_nvfp4 = "gift+nvfp4"


def resolve(compression: Any) -> tuple[Any, Any]:
    """Split ``compression`` into (commwire codec spec or codec object, or None; Horovod compressor or None).

    Accepts None, a spec string, a commwire codec, a ``CodecCompressor`` or any
    object with ``compress``/``decompress`` (Horovod's interface).
    """
    if compression is None or compression is NoneCompressor or isinstance(compression, NoneCompressor) \
            or compression == "none":
        return None, None
    if isinstance(compression, CodecCompressor):
        return compression.spec, None
    from ..codecs.base import Codec

    if isinstance(compression, (str, Codec)):
        return compression, None
    if callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None)):
        return None, compression
    raise TypeError(f"compression={compression!r} is not a Compressor (an object with compress()/decompress()), "
                    "a commwire codec or a codec spec string such as 'fp8-e4m3'")
