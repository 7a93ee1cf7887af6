"""Error feedback: carry each step's quantisation error into the next step.

``ErrorFeedback(codec)`` encodes ``y = x + residual[key]`` and stores
``residual[key] = y - decode(encode(y))``, so errors are not lost but delayed,
and their sum over steps stays bounded instead of growing (Seide et al. 2014,
Karimireddy et al. 2019). Residuals live in ``codec.state`` keyed by the caller's
stable key (one per tensor or bucket) and are saved by ``codec.state_dict()``.
Non-finite residual entries (from NaN/Inf input, e.g. an AMP overflow step that
the loss scaler skips) are reset to 0 so one bad step does not poison later ones.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

import numpy as np

from ..comm import arrays
from .base import Codec, Span, Wrapper, kernels

__all__ = ["ErrorFeedback"]


def _like(value: Any, x: Any) -> Any:
    """Return ``value`` as the same array kind and device as ``x``."""
    if isinstance(x, np.ndarray):
        return value if isinstance(value, np.ndarray) else value.detach().cpu().numpy()
    import torch

    return torch.as_tensor(value, device=x.device)


class ErrorFeedback(Wrapper):
    """Wrap a codec so that each key's quantisation error is added to its next input."""

    device_capable = True  # its own kernels run on the device; the wrapped codec's stages declare theirs

    def __init__(self, codec: Codec) -> None:
        super().__init__()
        if not isinstance(codec, Codec):
            raise TypeError(f"ErrorFeedback wraps a Codec, got {type(codec).__name__}")
        self.codec = codec
        self.lossless = codec.lossless

    @property
    def spec(self) -> str:
        """Return ``"ef+<inner spec>"``."""
        return f"ef+{self.codec.spec}"

    def residual(self, key: Hashable = None) -> Any:
        """Return the current residual of ``key`` (None before its first encode)."""
        return self.state.slot(key).get("residual") if key in self.state else None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_scratch"}  # scratch is not state

    def _scratch_f32(self, x: Any, n: int, slot: int) -> Any:
        """Return ``n`` float32 elements of scratch ``slot`` on x's device, per thread (grown, never shrunk).

        Error feedback needs two tensor-sized temporaries per encode; allocating them
        anew each time page-faults a fresh tensor's worth of memory, which costs more
        than the encoding itself.
        """
        buffers = self.__dict__.setdefault("_scratch", {})
        where = (threading.get_ident(), slot, "numpy" if isinstance(x, np.ndarray) else str(x.device))
        buf = buffers.get(where)
        if buf is None or int(buf.shape[0]) < n:
            buf = buffers[where] = arrays.empty_f32(x, n)
        return buf[:n]

    def _residual_for(self, x: Any, key: Hashable, n: int) -> Any:
        """Return the residual of ``key`` (a view of the whole tensor's for a Span) as x's kind, or None."""
        if isinstance(key, Span):  # a piece of a longer tensor: its slice of the tensor's residual
            slot = self.state.slot(key.base)
            whole = slot.get("residual")
            if whole is None or int(whole.shape[0]) != key.total:
                whole = slot["residual"] = arrays.zeros(x, key.total)  # x: float32, as residuals are
            elif _like(whole, x) is not whole:  # e.g. restored from a checkpoint on another device
                whole = slot["residual"] = _like(whole, x)
            return whole[key.start:key.start + n]
        slot = self.state.slot(key)
        residual = slot.get("residual")
        if residual is None:
            return None
        if int(residual.shape[0]) != n:
            raise ValueError(
                f"error-feedback residual of key {key!r} has {int(residual.shape[0])} elements, the input {n}; "
                "pass a distinct key per tensor or bucket (or call codec.state.clear() after rebuilding buckets)"
            )
        if _like(residual, x) is not residual:
            residual = slot["residual"] = _like(residual, x)
        return residual

    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        n = int(x.shape[0])
        k = kernels(arrays.kind_of(x))
        residual = self._residual_for(x, key, n)
        y = self._scratch_f32(x, n, 0)
        fused = getattr(self.codec, "_encode_feedback", None)
        if residual is not None and fused is not None and fused(x, residual, y, out):
            return  # the inner codec did all of the below in two passes
        if residual is None:
            y[...] = x
        else:
            k.add_into(x, residual, y)
        self.codec._encode(y, out, key)
        decoded = self.codec._decode(out, n, self._scratch_f32(x, n, 1))
        if residual is None:  # the state is written only once encoding has worked
            residual = self.state.slot(key)["residual"] = arrays.empty_f32(x, n)
        k.feedback_residual(y, decoded, residual)

    def _decode(self, buf: Any, n: int, out: Any) -> Any:
        return self.codec._decode(buf, n, out)

    def _decode_add(self, buf: Any, n: int, out: Any) -> None:
        self.codec._decode_add(buf, n, out)  # decoding passes through: use the wrapped codec's fused kernel
