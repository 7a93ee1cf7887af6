"""SStepGram: fold s inner steps into one allreduce of margins and block-lower Gram."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numba
import numpy as np

from .._validate import positive_int
from ..comm.runtime import default_comm
from .base import Ticker, check_step

__all__ = ["SStepGram"]


_FULL_FROM = 4
"""From this s on, numpy panels use one full GEMM + pack (below it the per-step GEMMs are cheaper)."""


@numba.njit(cache=True, nogil=True)
def _pack(full: np.ndarray, out: np.ndarray, k: int, b: int) -> None:  # pragma: no cover - compiled
    """Copy the chunks [v_j | G_j,<j] of steps j < k from the full panel product into the payload."""
    pos = 0
    for j in range(k):
        width = 1 + j * b
        for i in range(b):
            row = full[1 + j * b + i]
            for c in range(width):
                out[pos + c] = row[c]
            pos += width


def _module_named(name: str) -> Any:
    if name == "numpy":
        return np
    if name == "cupy":
        try:
            import cupy
        except ImportError as exc:  # optional dependency: fail at first use with the hint
            raise ImportError("xp='cupy' needs CuPy: pip install cupy-cuda12x") from exc
        return cupy
    raise ValueError(f"xp={name!r} is not supported; choose 'numpy' or 'cupy'")


class SStepGram(Ticker):
    """Fold s inner steps of b rows into one allreduce of margins and the block-lower Gram.

    Each rank fills a panel A = [w^T; Y_0; ...; Y_{s-1}] ((1 + s*b) x n_local): row 0
    is its slice of the weights, the rows below the s stacked batches of its column
    block. `exchange(k)` computes, per step j < k, the chunk
    C_j = Y_j A[:1 + j*b]^T = [v_j | G_j0 ... G_j,j-1]  (b x (1 + j*b)),
    i.e. the base margins v_j = Y_j w and the strictly block-lower Gram row, then sums
    the chunks over the ranks in ONE allreduce of words(k, b) = k*b + k(k-1)/2 * b^2 numbers. Chunks are
    laid out step by step, so a short final group of k < s steps sends a prefix of
    the same buffer. With s = 1 this is exactly the margins message of plain SGD.

    How the chunks are computed depends on the array module. On numpy, one GEMM of
    the whole panel A A^T followed by a compiled copy of the block-lower part: it
    does twice the flops of the triangle, yet beats s skinny GEMMs (b rows each),
    whose per-call overhead dominates at these sizes; used from s = 4 on. For
    smaller s, and on other modules (cupy), one GEMM per step straight into the
    payload, so no diagonal or upper blocks are formed.

    As a schedule (see :class:`commwire.schedules.Schedule`), the exchange of a
    group happens before its first step: :meth:`tick` is True at steps 1, 1 + s,
    1 + 2s, ...; ``syncs`` counts the exchanges.

    Everything is allocated once here; exchange() allocates nothing (except for a
    short final group of k < s steps, on numpy).

    Example:
        >>> ex = SStepGram(s=4, b=8, n_local=16, dtype="float32")
        >>> ex.rows[:] = Y; ex.weights[:] = w
        >>> payload = ex.exchange()
        >>> v, G = ex.margins(payload, 2), ex.gram_row(payload, 2)
    """

    def __init__(self, *, s: int, b: int, n_local: int, dtype: Any = "float64",
                 comm_dtype: Any = None, comm: Any = None, xp: str = "numpy") -> None:
        """Allocate the panel and payload buffers for groups of up to s steps of b rows."""
        positive_int("s", s)
        positive_int("b", b)
        if not isinstance(n_local, (int, np.integer)) or n_local < 0:
            raise ValueError(f"n_local={n_local!r} must be a non-negative integer")
        self.s, self.b, self.n_local = int(s), int(b), int(n_local)
        self.xp = _module_named(xp)
        self.dtype = np.dtype(dtype)
        self.comm_dtype = np.dtype(comm_dtype if comm_dtype is not None else dtype)
        for label, dt in (("dtype", self.dtype), ("comm_dtype", self.comm_dtype)):
            if dt not in (np.float32, np.float64):
                raise ValueError(f"{label}={dt} is not supported; choose float32 or float64 (BLAS dtypes)")
        self.comm = default_comm(comm, init_if_needed=True)
        xp_ = self.xp
        self.panel = xp_.zeros((1 + self.s * self.b, self.n_local), dtype=self.dtype)
        self.weights = self.panel[0]
        self.rows = self.panel[1:]
        total = self.words(self.s, self.b)
        self._local = xp_.zeros(total, dtype=self.dtype)
        # A separate wire buffer only when the payload is cast for the allreduce.
        same = self.comm_dtype == self.dtype
        self._wire = self._local if same else xp_.zeros(total, dtype=self.comm_dtype)
        b_ = self.b
        self._full = (np.empty((1 + self.s * b_, 1 + self.s * b_), dtype=self.dtype)
                      if xp_ is np and self.s >= _FULL_FROM else None)
        self._gemms = []  # per-step GEMMs, only where the full panel product is not used
        for j in range(0 if self._full is not None else self.s):
            off = self.offset(j)
            out = self._local[off:off + b_ * (1 + j * b_)].reshape(b_, 1 + j * b_)
            self._gemms.append((self.panel[1 + j * b_:1 + (j + 1) * b_], self.panel[:1 + j * b_].T, out))
        self.steps = 0
        self.syncs = 0

    @staticmethod
    def words(s: int, b: int) -> int:
        """Return the numbers sent per group of s steps: s*b margins + s(s-1)/2 b^2 Gram entries."""
        return s * b + (s * (s - 1) // 2) * b * b

    def offset(self, j: int) -> int:
        """Return where step j's chunk [v_j | G_j,<j] starts in the payload."""
        return self.words(j, self.b)

    def nbytes(self, k: int | None = None) -> int:
        """Return the bytes one exchange of k steps hands to the allreduce."""
        return self.words(self.s if k is None else k, self.b) * self.comm_dtype.itemsize

    def compute(self, k: int | None = None) -> Any:
        """Compute this rank's chunks for the first k steps of the panel; return the local payload."""
        k = self.s if k is None else k
        if self._full is not None:
            rows = 1 + k * self.b
            a = self.panel[:rows]
            full = np.matmul(a, a.T, out=self._full) if k == self.s else a @ a.T
            _pack(full, self._local, k, self.b)
            return self._local[:self.words(k, self.b)]
        matmul = self.xp.matmul
        for a, bt, out in self._gemms[:k]:
            matmul(a, bt, out=out)
        return self._local[:self.words(k, self.b)]

    def reduce(self, k: int | None = None) -> Any:
        """Sum the first k steps' local chunks over the ranks in one allreduce; return the sum."""
        k = self.s if k is None else k
        n = self.words(k, self.b)
        wire = self._wire[:n]
        if self._wire is not self._local:
            self.xp.copyto(wire, self._local[:n], casting="same_kind")
        # The Communicator moves device arrays itself (CUDA-aware or host-staged).
        self.comm.allreduce(wire, op="sum", out=wire)
        self.syncs += 1
        return wire

    def exchange(self, k: int | None = None) -> Any:
        """Compute and sum the first k steps' chunks (default s); return the reduced payload."""
        self.compute(k)
        return self.reduce(k)

    def margins(self, payload: Any, j: int) -> Any:
        """Return v_j = Y_j w (length b) from a payload."""
        return self.chunk(payload, j)[:, 0]

    def gram_row(self, payload: Any, j: int) -> Any:
        """Return [G_j0 ... G_j,j-1] (b x j*b) from a payload."""
        return self.chunk(payload, j)[:, 1:]

    def chunk(self, payload: Any, j: int) -> Any:
        """Return step j's chunk [v_j | G_j,<j] (b x (1 + j*b)) from a payload."""
        if not 0 <= j < self.s:
            raise IndexError(f"step j={j} is outside 0..{self.s - 1}")
        off, b_ = self.offset(j), self.b
        return payload[off:off + b_ * (1 + j * b_)].reshape(b_, 1 + j * b_)

    # ---------------------------------------------------------------- schedule
    def due(self, step: int) -> bool:
        """Return whether inner step ``step`` (counting from 1) starts a group, i.e. needs an exchange first."""
        return (check_step(step) - 1) % self.s == 0

    @property
    def bytes_per_sync(self) -> int:
        """Return the bytes one exchange of a full group hands to the allreduce."""
        return self.nbytes()

    @property
    def messages_per_sync(self) -> int:
        """Return the collectives one exchange issues: one allreduce."""
        return 1

    def state_dict(self) -> dict[str, Any]:
        """Return the counters (the panel is refilled for every group: it is no state)."""
        return {"steps": self.steps, "syncs": self.syncs}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.steps = int(state["steps"])
        self.syncs = int(state["syncs"])
