"""Build codecs from spec strings: ``codecs.get("ef+hadamard+fp8-e4m3:block=128,sr")``.

Grammar::

    spec   := stage ("+" stage)*         # outermost first; the last stage is a codec
    stage  := name [":" option ("," option)*]
    option := key "=" integer | flag

Codecs (the last stage), with their options:

- ``none`` (alias ``identity``): float32 bytes, lossless, 4 B/element.
- ``fp16``, ``bf16``: 16-bit casts, 2 B/element.
- ``fp8-e4m3``, ``fp8-e5m2``: 1 B/element + FP32 scales; ``block=N`` for one scale
  per N elements (default: one per tensor), ``sr`` for stochastic rounding,
  ``seed=N`` for its seed.
- ``nvfp4``: 0.5625 B/element + 4 B; ``sr``, ``seed=N``.
- ``mxfp8-e4m3``, ``mxfp8-e5m2``, ``mxfp4``: OCP MX, 32-element blocks with E8M0 scales:
  1.03125 / 0.53125 B/element; ``sr``, ``seed=N``.
- ``int8``, ``int4``: symmetric integers with FP32 block scales, 1 + 4/B and 0.5 + 4/B
  B/element; ``block=N`` (default 128 / 32), ``sr``, ``seed=N``.
- ``sign``: one bit per element and a mean-|x| FP32 scale per block, 0.125 + 4/B
  B/element; ``block=N`` (a multiple of 8, default 128). Use it as ``ef+sign``.

Wrapper stages (each wraps everything to its right):

- ``ef``: error feedback (state keyed by the ``key`` passed to encode).
- ``hadamard``: random Hadamard rotation; ``size=N`` (power of two, default 16),
  ``seed=N`` (shared signs, default 0).
- ``gift``: input-whitened weight gradients (:mod:`commwire.codecs.gift`); ``rank=N``,
  ``refresh=N``, ``ef=0/1``, ``profile=N``, ``top=N``.

Flags: ``sr`` means ``rounding=sr``; ``rne`` (the default) means ``rounding=rne``.
Names and options are case-insensitive. ``codec.spec`` is the canonical form
(defaults omitted) and ``get(codec.spec)`` rebuilds an equivalent codec.
Add codecs with :func:`register_codec` and wrappers with :func:`register_stage`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Codec
from .casts import CastCodec, IdentityCodec
from .feedback import ErrorFeedback
from .fp8 import Fp8Codec
from .gift import Gift
from .hadamard import HadamardTransform
from .integer import IntCodec
from .mx import MxCodec
from .nvfp4 import Nvfp4Codec
from .pipeline import Pipeline
from .sign import SignCodec

__all__ = ["get", "register_codec", "register_stage", "available"]

CodecFactory = Callable[..., Codec]
StageFactory = Callable[..., Codec]

# The registry starts with the built-in codecs and wrapper stages; register_codec/register_stage add more.
_CODECS: dict[str, CodecFactory] = {
    "none": IdentityCodec,
    "identity": IdentityCodec,
    "fp16": lambda: CastCodec(format="fp16"),
    "bf16": lambda: CastCodec(format="bf16"),
    "fp8-e4m3": lambda **options: Fp8Codec(format="e4m3", **options),
    "fp8-e5m2": lambda **options: Fp8Codec(format="e5m2", **options),
    "nvfp4": Nvfp4Codec,
    "mxfp8-e4m3": lambda **options: MxCodec(element="e4m3", **options),
    "mxfp8-e5m2": lambda **options: MxCodec(element="e5m2", **options),
    "mxfp4": lambda **options: MxCodec(element="e2m1", **options),
    "int8": lambda **options: IntCodec(bits=8, **options),
    "int4": lambda **options: IntCodec(bits=4, **options),
    "sign": SignCodec,
}
_STAGES: dict[str, StageFactory] = {
    "ef": ErrorFeedback,
    "hadamard": lambda inner, **options: Pipeline(HadamardTransform(**options), inner),
    "gift": Gift.from_spec,
}
_FLAGS = {"sr": ("rounding", "sr"), "rne": ("rounding", "rne")}


def register_codec(name: str, factory: CodecFactory) -> None:
    """Register ``factory(**options) -> Codec`` as the codec ``name``."""
    _register(_CODECS, name, factory)


def register_stage(name: str, factory: StageFactory) -> None:
    """Register ``factory(inner: Codec, **options) -> Codec`` as the wrapper stage ``name``."""
    _register(_STAGES, name, factory)


def _register(table: dict[str, Any], name: str, factory: Any) -> None:
    key = name.strip().lower()
    if not key or any(c in key for c in "+:,="):
        raise ValueError(f"stage name {name!r} must be non-empty and contain none of '+', ':', ',', '='")
    if key in _CODECS or key in _STAGES:
        raise ValueError(f"stage name {name!r} is already registered")
    if not callable(factory):
        raise TypeError(f"factory for {name!r} must be callable, got {type(factory).__name__}")
    table[key] = factory


def available() -> dict[str, list[str]]:
    """Return the registered names: ``{"codecs": [...], "stages": [...]}``."""
    return {"codecs": sorted(_CODECS), "stages": sorted(_STAGES)}


def _parse_stage(text: str, spec: str) -> tuple[str, dict[str, Any]]:
    name, _, opts = text.strip().lower().partition(":")
    options: dict[str, Any] = {}
    for raw in filter(None, (o.strip() for o in opts.split(","))):
        if raw in _FLAGS:
            key, value = _FLAGS[raw]
        elif "=" in raw:
            key, _, value_text = raw.partition("=")
            key, value_text = key.strip(), value_text.strip()
            digits = value_text[1:] if value_text.startswith("-") else value_text
            if not (digits.isascii() and digits.isdigit()):
                raise ValueError(f"option {raw!r} in codec spec {spec!r} needs an integer value, e.g. block=128")
            if key == "config":  # the factories' config= takes a config object, never a spec value
                raise ValueError(f"option 'config' in codec spec {spec!r} is not a spec option; give the "
                                 "options themselves, e.g. 'fp8-e4m3:block=128'")
            value = int(value_text)
        else:
            raise ValueError(f"unknown flag {raw!r} in codec spec {spec!r}; flags: {', '.join(_FLAGS)}; or key=value")
        if key in options:
            raise ValueError(f"option {key!r} given twice in codec spec {spec!r}")
        options[key] = value
    return name.strip(), options


def _build(factory: Callable[..., Codec], name: str, options: dict[str, Any], spec: str, *inner: Codec) -> Codec:
    try:
        return factory(*inner, **options)
    except TypeError as error:  # an option the factory does not take
        raise ValueError(f"bad options {options} for {name!r} in codec spec {spec!r}: {error}") from None


def get(spec: str | Codec | None) -> Codec:
    """Return a new codec for ``spec`` (see the module docstring for the grammar).

    ``None`` gives ``none``; a :class:`Codec` is returned as is.

    Example:
        >>> get("ef+fp8-e4m3").spec
        'ef+fp8-e4m3'
        >>> get("fp8-e4m3:block=128,sr").wire_nbytes(1000)
        1032
    """
    if spec is None:
        spec = "none"
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"codec spec must be a str, a Codec or None, got {type(spec).__name__}")
    parts = [_parse_stage(p, spec) for p in spec.split("+")]
    name, options = parts[-1]
    if name not in _CODECS:
        hint = " (it is a wrapper stage; end the spec with a codec)" if name in _STAGES else ""
        raise ValueError(
            f"unknown codec {name!r} in spec {spec!r}{hint}; valid codecs: {', '.join(sorted(_CODECS))}; "
            f"wrapper stages: {', '.join(sorted(_STAGES))} (e.g. 'ef+fp8-e4m3')"
        )
    codec = _build(_CODECS[name], name, options, spec)
    for name, options in reversed(parts[:-1]):
        if name not in _STAGES:
            raise ValueError(
                f"unknown stage {name!r} in spec {spec!r}; wrapper stages: {', '.join(sorted(_STAGES))}; "
                f"codecs (last only): {', '.join(sorted(_CODECS))}"
            )
        codec = _build(_STAGES[name], name, options, spec, codec)
    return codec
