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

from collections.abc import Hashable
from typing import Any

import numpy as np

from . import _arrays
from .base import Codec, Span, Wrapper

__all__ = ["ErrorFeedback"]


def _like(value: Any, x: Any) -> Any:
    """Return ``value`` as the same array kind and device as ``x``."""
    if isinstance(x, np.ndarray):
        return value if isinstance(value, np.ndarray) else value.detach().cpu().numpy()
    import torch

    return torch.as_tensor(value, device=x.device)


def _zeros_like(x: Any, n: int) -> Any:
    """Return ``n`` float32 zeros of the same array kind and device as ``x``."""
    if isinstance(x, np.ndarray):
        return np.zeros(n, dtype=np.float32)
    import torch

    return torch.zeros(n, dtype=torch.float32, device=x.device)


def _zero_nonfinite(r: Any) -> Any:
    if isinstance(r, np.ndarray):
        return np.nan_to_num(r, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
    return r.nan_to_num_(0.0, 0.0, 0.0)


class ErrorFeedback(Wrapper):
    """Wrap a codec so that each key's quantisation error is added to its next input."""

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

    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        n = int(x.shape[0])
        if isinstance(key, Span):  # a piece of a longer tensor: its slice of the tensor's residual
            slot = self.state.slot(key.base)
            whole = slot.get("residual")
            if whole is None or int(whole.shape[0]) != key.total:
                whole = slot["residual"] = _zeros_like(x, key.total)
            residual = whole[key.start:key.start + n]
        else:
            slot = self.state.slot(key)
            whole = None
            residual = slot.get("residual")
            if residual is not None and int(residual.shape[0]) != n:
                raise ValueError(
                    f"error-feedback residual of key {key!r} has {int(residual.shape[0])} elements, the input {n}; "
                    "pass a distinct key per tensor or bucket (or call codec.state.clear() after rebuilding buckets)"
                )
        if residual is None:
            y = x.copy() if isinstance(x, np.ndarray) else x.clone()
        else:
            y = x + _like(residual, x)
        self.codec._encode(y, out, key)
        decoded = self.codec._decode(out, n, _arrays.empty_f32(x, n))
        y -= decoded
        y = _zero_nonfinite(y)
        if whole is not None:
            residual[...] = _like(y, residual)
        else:
            slot["residual"] = y

    def _decode(self, buf: Any, n: int, out: Any) -> Any:
        return self.codec._decode(buf, n, out)

    def _decode_add(self, buf: Any, n: int, out: Any) -> None:
        self.codec._decode_add(buf, n, out)  # decoding passes through: use the wrapped codec's fused kernel
