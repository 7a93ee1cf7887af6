"""Define the codec contract: :class:`Codec`, :class:`Payload` and :class:`CodecState`.

A codec turns a float array into bytes for the wire and back. Two levels:

- ``encode(x, key=None) -> Payload`` / ``decode(payload, out=None) -> array`` for
  any shape and float dtype, numpy, torch (CPU/CUDA) or cupy; decoding returns the
  same kind of array with the original shape and dtype (computation is float32).
- ``encode_into(x, out, key=None)`` / ``decode_from(buf, n, out=None)`` on flat
  float32 vectors and raw uint8 buffers of exactly ``wire_nbytes(n)`` bytes, for
  collectives that encode chunks into slices of one preallocated send buffer;
  ``decode_add(buf, n, out)`` adds the decoded values to ``out`` (a reduction).

No header goes on the wire: the receiver must know the codec and the element
count. A :class:`Payload` carries that metadata on the Python side (not counted in
``nbytes``), so ``decode`` can reject a payload from another codec or a truncated
buffer; ``decode_from`` can only check the length, so collectives must agree on
the codec spec beforehand.

Settings live in each codec's frozen ``Config`` dataclass; mutable state (error
feedback residuals, stochastic-rounding counters) lives in one :class:`CodecState`
per stage, keyed by the caller's stable ``key`` (a bucket or tensor name), and is
saved with ``codec.state_dict()``.
"""

from __future__ import annotations

import abc
import dataclasses
import zlib
from collections.abc import Hashable
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from ..comm import arrays

__all__ = ["Codec", "KernelCodec", "Wrapper", "Payload", "CodecState", "Span", "stream_id", "next_stream", "kernels",
           "check_float", "check_rounding", "rounding_options"]

_STATE_VERSION = 1

_kernel_modules: dict[str, ModuleType] = {}


def kernels(kind: str) -> ModuleType:
    """Return the kernel module for an array kind: numba for numpy, torch ops for torch (and cupy, via DLPack)."""
    module = _kernel_modules.get(kind)  # every codec call asks: skip the import machinery
    if module is None:
        if kind == "numpy":
            from . import _kernels as module
        else:
            from . import _torch_kernels as module
        _kernel_modules[kind] = module
    return module


def check_float(x: Any, spec: str) -> None:
    """Raise TypeError unless ``x`` holds float16/bfloat16/float32/float64 values."""
    name = arrays.dtype_name(x.dtype)
    if name not in arrays.FLOAT_NAMES:
        raise TypeError(
            f"codec {spec!r} encodes floating-point arrays ({', '.join(arrays.FLOAT_NAMES)}), got {name}; "
            "cast first (x.astype(numpy.float32)) or send integer/boolean data without a codec"
        )


def check_rounding(owner: str, rounding: str, seed: int) -> None:
    """Raise ValueError unless ``rounding`` is ``"rne"``/``"sr"`` and ``seed`` an int in [0, 2**32) (``owner``: the config)."""
    if rounding not in ("rne", "sr"):
        raise ValueError(f"{owner}.rounding={rounding!r}; use 'rne' or 'sr'")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"{owner}.seed={seed!r}; use an int in [0, 2**32)")


def rounding_options(rounding: str, seed: int) -> list[str]:
    """Return a rounding setting's spec options: none for round to nearest, ``sr`` and ``seed=N`` (if not 0)."""
    if rounding == "rne":
        return []
    return ["sr"] + ([f"seed={seed}"] if seed else [])


@dataclasses.dataclass(frozen=True, slots=True)
class Payload:
    """Encoded bytes plus the metadata needed to decode them (metadata is not on the wire)."""

    data: Any
    """One contiguous 1-D uint8 array: numpy, torch or cupy, like the encoded input."""
    spec: str
    """Canonical spec of the codec that produced it."""
    shape: tuple[int, ...]
    """Shape of the encoded array."""
    dtype: str
    """Element type name of the encoded array (``"float32"``, ``"bfloat16"``, ...)."""
    n: int
    """Number of elements."""
    kind: str
    """``"numpy"``, ``"torch"`` or ``"cupy"``."""

    @property
    def nbytes(self) -> int:
        """Return the exact number of bytes that go on the wire."""
        return int(self.data.shape[0])


class Span(NamedTuple):
    """Key of a piece of a longer tensor: elements [start, start + len) of ``total`` keyed by ``base``.

    Stateful stages (error feedback) keep one state for the whole tensor under
    ``base`` and use the piece's slice of it, so the state survives a change of
    how the tensor is cut (the compressed all-reduce's pipeline segments, which
    its tuner varies on the first calls).
    """

    base: Hashable
    start: int
    total: int


class CodecState:
    """Hold one stage's mutable state: a dict of named values per caller key."""

    def __init__(self) -> None:
        self._slots: dict[Hashable, dict[str, Any]] = {}

    def slot(self, key: Hashable) -> dict[str, Any]:
        """Return the (possibly new, empty) state dict of ``key``."""
        return self._slots.setdefault(key, {})

    def keys(self) -> list[Hashable]:
        """Return the keys that have state."""
        return list(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def clear(self) -> None:
        """Drop all state (e.g. when buckets are rebuilt with new keys)."""
        self._slots.clear()

    def state_dict(self) -> dict[Hashable, dict[str, Any]]:
        """Return a picklable copy: numpy arrays (host copies of device tensors) and ints."""
        return {key: {name: _to_host(value) for name, value in slot.items()} for key, slot in self._slots.items()}

    def load_state_dict(self, state: dict[Hashable, dict[str, Any]]) -> None:
        """Replace the state with a copy of ``state`` (as returned by :meth:`state_dict`)."""
        if not isinstance(state, dict):
            raise TypeError(f"CodecState.load_state_dict expects a dict, got {type(state).__name__}")
        self._slots = {key: {name: _to_host(value) for name, value in slot.items()} for key, slot in state.items()}


def _to_host(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool, np.integer, np.floating)):
        return value
    if isinstance(value, np.ndarray):
        return value.copy()
    if arrays.kind_of(value) == "cupy":
        value = arrays.to_torch(value)
    return value.detach().cpu().numpy().copy()


def stream_id(seed: int, key: Hashable, counter: int) -> int:
    """Return a 32-bit random-stream id for (seed, key, call counter), stable across processes."""
    # repr() of str/int/tuple keys is stable, unlike hash() of str (PYTHONHASHSEED).
    return zlib.crc32(f"{seed}|{key!r}|{counter}".encode())


def next_stream(state: CodecState, seed: int, key: Hashable) -> int:
    """Return the random-stream id for this call of ``key`` and advance its counter."""
    slot = state.slot(key)
    counter = int(slot.get("counter", 0))
    slot["counter"] = counter + 1
    return stream_id(seed, key, counter)


class Codec(abc.ABC):
    """Encode float arrays to wire bytes and decode them back.

    Example:
        >>> from commwire import codecs
        >>> codec = codecs.get("fp8-e4m3")
        >>> payload = codec.encode(np.ones(1000, np.float32))
        >>> payload.nbytes
        1004
        >>> codec.decode(payload)[:3]
        array([1., 1., 1.], dtype=float32)
    """

    lossless: bool = False
    """True when decode(encode(x)) == x for float32 (and narrower) input."""

    device_capable: bool = False
    """True when this stage's own work runs on torch tensors on their device (its kernels take CUDA
    tensors): a compressed collective then keeps device arrays on the device if every stage of the
    codec says so (:func:`commwire.codecs.collective.has_device_kernels`), and reduces them through
    a host copy otherwise. A codec stays on the host unless it declares this."""

    def __init__(self) -> None:
        self.state = CodecState()

    # ---- what a codec defines -------------------------------------------------
    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """Return the canonical spec string; ``codecs.get(spec)`` rebuilds an equal codec."""

    @abc.abstractmethod
    def wire_nbytes(self, n: int) -> int:
        """Return the exact payload size in bytes for ``n`` elements."""

    @abc.abstractmethod
    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        """Encode a validated flat float32 vector into ``out`` (exactly wire_nbytes bytes)."""

    @abc.abstractmethod
    def _decode(self, buf: Any, n: int, out: Any) -> Any:
        """Decode a validated buffer into the float32 vector ``out`` and return it."""

    def _decode_add(self, buf: Any, n: int, out: Any) -> None:
        """Add the decoded values of a validated buffer to ``out``, as ``out += decoded``.

        Here: decode into a temporary vector, then add. Codecs with a fused
        kernel override this; the result must stay bit-identical.
        """
        out += self._decode(buf, n, arrays.empty_f32(out, n))

    @property
    def stages(self) -> tuple[Codec, ...]:
        """Return this codec and the codecs it wraps, outermost first."""
        return (self,)

    # ---- whole-tensor coordinates (GIFT-style transforms) ----------------------
    def tensor_forward(self, x: Any, key: Hashable = None) -> Any:
        """Map a whole flat float32 tensor to wire coordinates before a collective chunks it.

        Identity here. A transform that must see whole weight matrices (rows
        cut across chunks) overrides this; it must be linear and identical on
        every rank, so that it commutes with the sum. Never modifies ``x``.
        """
        return x

    def tensor_inverse(self, y: Any, key: Hashable = None) -> None:
        """Map a reduced flat tensor back from wire coordinates, in place (identity here)."""

    def bind_layout(self, key: Hashable, layout: list[tuple[str, int, tuple[int, ...]]]) -> None:
        """Learn which named tensors (name, offset, shape) a fused buffer ``key`` holds (unused here)."""

    # ---- low-level API: flat float32 and raw bytes ----------------------------
    def encode_into(self, x: Any, out: Any, key: Hashable = None) -> None:
        """Encode the flat float32 vector ``x`` into ``out``, a uint8 buffer of wire_nbytes(len(x))."""
        kind = arrays.kind_of(x)
        if len(x.shape) != 1 or arrays.dtype_name(x.dtype) != "float32":
            raise ValueError(
                f"encode_into takes a 1-D float32 vector, got shape {tuple(x.shape)} "
                f"{arrays.dtype_name(x.dtype)}; use encode() for other shapes and dtypes"
            )
        n = int(x.shape[0])
        self._check_buffer(out, n, "out")
        if kind == "cupy":
            x, out = arrays.to_torch(x), arrays.to_torch(out)
        if not _is_contiguous(x):
            x = arrays.flat_f32(x, arrays.kind_of(x))
        self._encode(x, out, key)

    def decode_from(self, buf: Any, n: int, out: Any = None) -> Any:
        """Decode ``n`` elements from the uint8 buffer ``buf`` into a flat float32 vector."""
        n, kind, tbuf = self._check_encoded(buf, n)
        if out is None:
            target = arrays.empty_f32(tbuf, n)
        else:
            target = self._check_out(out, n, kind)
        self._decode(tbuf, n, target)
        return out if out is not None else arrays.from_torch(target, kind)

    def decode_add(self, buf: Any, n: int, out: Any) -> Any:
        """Decode ``n`` elements from ``buf`` and add them to ``out`` in place.

        The result is bit-identical to ``out += decode_from(buf, n)``: each
        value is decoded and rounded to float32 first, then added. NVFP4, FP8
        and the fp16/bf16 casts (and stages around them that only pass decoding
        through, such as error feedback) do it in one pass without a temporary
        vector; other codecs decode into a temporary and add.

        Args:
            buf: uint8 buffer of exactly ``wire_nbytes(n)`` bytes.
            n: the number of encoded elements.
            out: float32 vector of ``n`` elements, the same array kind (and device) as ``buf``.

        Returns:
            ``out``, updated.

        Example:
            >>> total = own_chunk.copy()
            >>> for buf in received:
            ...     codec.decode_add(buf, total.size, total)
        """
        n, kind, tbuf = self._check_encoded(buf, n)
        if arrays.kind_of(out) != kind:
            raise ValueError(f"out is a {arrays.kind_of(out)} array and buf a {kind} one; decode_add needs one kind")
        self._decode_add(tbuf, n, self._check_out(out, n, kind))
        return out

    def _check_encoded(self, buf: Any, n: Any) -> tuple[int, str, Any]:
        """Validate ``n`` and ``buf``; return n, the array kind and ``buf`` as the kernels take it."""
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        n = int(n)
        self._check_buffer(buf, n, "buf")
        kind = arrays.kind_of(buf)
        return n, kind, (arrays.to_torch(buf) if kind == "cupy" else buf)

    def _check_out(self, out: Any, n: int, kind: str) -> Any:
        """Validate a float32 output vector of ``n`` elements; return it as the kernels take it."""
        if tuple(out.shape) != (n,) or arrays.dtype_name(out.dtype) != "float32":
            raise ValueError(f"out must be a float32 vector of {n} elements, got {tuple(out.shape)} "
                             f"{arrays.dtype_name(out.dtype)}")
        return arrays.to_torch(out) if kind == "cupy" else out

    def _check_buffer(self, buf: Any, n: int, name: str) -> None:
        expected = self.wire_nbytes(n)
        if len(buf.shape) != 1 or arrays.dtype_name(buf.dtype) != "uint8":
            raise ValueError(f"{name} must be a 1-D uint8 buffer, got shape {tuple(buf.shape)} "
                             f"{arrays.dtype_name(buf.dtype)}")
        if int(buf.shape[0]) != expected:
            raise ValueError(
                f"{name} holds {int(buf.shape[0])} bytes but codec {self.spec!r} needs wire_nbytes({n}) = {expected}; "
                "a truncated buffer, a different element count or a payload of another codec"
            )

    # ---- high-level API: any shape, dtype and array kind ---------------------
    def encode(self, x: Any, key: Hashable = None) -> Payload:
        """Encode an array of any shape and float dtype into a :class:`Payload`."""
        kind = arrays.kind_of(x)
        check_float(x, self.spec)
        flat = arrays.flat_f32(x, kind)
        out = arrays.empty_u8(flat, self.wire_nbytes(int(flat.shape[0])))
        self._encode(flat, out, key)
        return Payload(
            data=arrays.from_torch(out, kind) if kind == "cupy" else out,
            spec=self.spec, shape=tuple(int(d) for d in x.shape), dtype=arrays.dtype_name(x.dtype),
            n=int(flat.shape[0]), kind=kind,
        )

    def decode(self, payload: Payload, out: Any = None) -> Any:
        """Decode a :class:`Payload` to an array of its original kind, shape and dtype."""
        if not isinstance(payload, Payload):
            raise TypeError(f"decode takes a Payload, got {type(payload).__name__}; use decode_from for raw bytes")
        if payload.spec != self.spec:
            raise ValueError(f"payload was encoded by codec {payload.spec!r}, this codec is {self.spec!r}")
        flat = self.decode_from(payload.data, payload.n)
        tflat = arrays.to_torch(flat) if payload.kind == "cupy" else flat
        return arrays.restore(tflat, payload.shape, payload.dtype, payload.kind, out)

    # ---- state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return the state of every stage, for checkpoints (picklable, host arrays)."""
        return {"version": _STATE_VERSION, "spec": self.spec, "stages": [s.state.state_dict() for s in self.stages]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state saved by :meth:`state_dict` of a codec with the same spec."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a codec state dict of version {_STATE_VERSION}: {type(state).__name__}")
        if state["spec"] != self.spec:
            raise ValueError(f"state was saved by codec {state['spec']!r}, this codec is {self.spec!r}")
        for stage, stage_state in zip(self.stages, state["stages"], strict=True):
            stage.state.load_state_dict(stage_state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


class KernelCodec(Codec):
    """A codec that decodes with one backend kernel and adds with its ``_add`` twin.

    Subclasses name the kernel (``decode_kernel = "mx_decode"``: ``mx_decode`` and
    ``mx_decode_add`` of the module :func:`kernels` picks) and return its arguments before
    ``out`` from :meth:`_decode_args`; the kernel pair stays bit-identical (decode, then add).
    """

    decode_kernel: str = ""
    """Name of the decode kernel in ``_kernels`` / ``_torch_kernels``."""

    @abc.abstractmethod
    def _decode_args(self, buf: Any, n: int, k: ModuleType) -> tuple:
        """Return the decode kernel's arguments before ``out`` for ``n`` elements in ``buf`` (``k``: the kernels)."""

    def _decode(self, buf: Any, n: int, out: Any) -> Any:
        k = kernels(arrays.kind_of(buf))
        getattr(k, self.decode_kernel)(*self._decode_args(buf, n, k), out)
        return out

    def _decode_add(self, buf: Any, n: int, out: Any) -> None:
        k = kernels(arrays.kind_of(buf))
        getattr(k, self.decode_kernel + "_add")(*self._decode_args(buf, n, k), out)


class Wrapper(Codec):
    """A codec stage around an inner codec (``self.codec``): sizes and whole-tensor hooks pass through."""

    codec: Codec

    @property
    def stages(self) -> tuple[Codec, ...]:
        """Return this stage and the stages of the wrapped codec."""
        return (self, *self.codec.stages)

    def wire_nbytes(self, n: int) -> int:
        """Return the wrapped codec's size: a wrapping stage adds no bytes."""
        return self.codec.wire_nbytes(n)

    def tensor_forward(self, x: Any, key: Hashable = None) -> Any:
        """Delegate whole-tensor mapping to the wrapped codec."""
        return self.codec.tensor_forward(x, key)

    def tensor_inverse(self, y: Any, key: Hashable = None) -> None:
        """Delegate the inverse whole-tensor mapping to the wrapped codec."""
        self.codec.tensor_inverse(y, key)

    def bind_layout(self, key: Hashable, layout: list[tuple[str, int, tuple[int, ...]]]) -> None:
        """Pass a fused buffer's layout on to the wrapped codec."""
        self.codec.bind_layout(key, layout)


def _is_contiguous(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return bool(x.flags.c_contiguous)
    return bool(x.is_contiguous())
