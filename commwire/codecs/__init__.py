"""Compress tensors for the wire: casts, FP8, NVFP4, MX, INT8/INT4, sign, Hadamard rotation, error feedback.

Get a codec from a spec string (grammar in :mod:`commwire.codecs.registry`)::

    from commwire import codecs
    codec = codecs.get("ef+fp8-e4m3")            # or "nvfp4", "fp8-e4m3:block=128,sr", ...
    payload = codec.encode(grad, key="layer1")     # payload.nbytes: exact wire bytes
    grad_hat = codec.decode(payload)               # same kind, shape and dtype as grad

Specs: ``none``, ``fp16``, ``bf16``, ``fp8-e4m3``, ``fp8-e5m2`` (options ``block=N``,
``sr``, ``seed=N``), ``int8``, ``int4`` (the same options), ``nvfp4``, ``mxfp8-e4m3``,
``mxfp8-e5m2``, ``mxfp4`` (``sr``, ``seed=N``), ``sign`` (``block=N``),
prefixed by wrapper stages ``ef+``, ``hadamard+`` (``size=N``, ``seed=N``) and ``gift+``.

Wire bytes for n elements (``codec.wire_nbytes(n)``): none 4n; fp16/bf16 2n;
FP8 n + 4 (per tensor) or n + 4*ceil(n/B) (block B); NVFP4 ceil(n/2) + ceil(n/16) + 4;
MXFP8 n + ceil(n/32); MXFP4 ceil(n/2) + ceil(n/32); INT8 n + 4*ceil(n/B); INT4
ceil(n/2) + 4*ceil(n/B); sign ceil(n/8) + 4*ceil(n/B). There is no header: receivers
must know the codec.

Non-finite values stay non-finite: NaN → NaN, ±Inf → ±Inf (fp16, bf16, E5M2) or NaN
(E4M3); in NVFP4, MX, INT8/INT4 and sign a block holding NaN/Inf decodes to NaN in all
its elements.
Integer and boolean arrays raise TypeError. numpy arrays run on fused numba
kernels (thread count: :func:`set_threads`); torch tensors (CPU or CUDA) on torch
ops; cupy arrays through torch via DLPack. Format parameters are data:
:data:`FORMATS`.
"""

from __future__ import annotations

from ._threads import blas_threads, get_threads, set_threads
from .base import Codec, CodecState, Payload
from .casts import CastCodec, CastConfig, IdentityCodec
from .feedback import ErrorFeedback
from .formats import FORMATS, FloatFormat, get_format
from .fp8 import Fp8Codec, Fp8Config
from .gift import Gift, GiftConfig
from .hadamard import HadamardConfig, HadamardTransform
from .integer import IntCodec, IntConfig
from .mx import MxCodec, MxConfig
from .nvfp4 import Nvfp4Codec, Nvfp4Config
from .pipeline import Pipeline, Transform, pipeline
from .sign import SignCodec, SignConfig
from .registry import available, get, register_codec, register_stage

__all__ = [
    "Codec",
    "CodecState",
    "Payload",
    "get",
    "available",
    "register_codec",
    "register_stage",
    "IdentityCodec",
    "CastCodec",
    "CastConfig",
    "Fp8Codec",
    "Fp8Config",
    "Nvfp4Codec",
    "Nvfp4Config",
    "MxCodec",
    "MxConfig",
    "IntCodec",
    "IntConfig",
    "SignCodec",
    "SignConfig",
    "HadamardTransform",
    "HadamardConfig",
    "Gift",
    "GiftConfig",
    "ErrorFeedback",
    "Pipeline",
    "Transform",
    "pipeline",
    "FloatFormat",
    "FORMATS",
    "get_format",
    "get_threads",
    "set_threads",
    "blas_threads",
]
