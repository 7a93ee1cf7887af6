"""Adasum all-reduce (Maleki et al., MLSys 2021) over an mpi4py communicator.

Adasum combines two gradients ``a`` and ``b`` as::

    adasum(a, b) = (1 - a·b / (2‖a‖²)) a + (1 - a·b / (2‖b‖²)) b

which is their sum when they are orthogonal and their average when they are
parallel. A vector whose squared norm is below ``sqrt(DBL_MIN)`` (about
1.5e-154) counts as zero: its partner keeps coefficient 1, so
``adasum(0, b) = b``. Horovod uses the same threshold; it only matters for
float64 data, since the squares of float16/bfloat16/float32 values never fall
that low in float64.

Over ``2**k`` ranks the pairs form a binary tree in rank order: level 1
combines ranks (0, 1), (2, 3), …; level 2 combines those pairs' results, and so
on (Horovod's tree). Dot products and norms are taken over the whole vector, or
over each tensor of a fused buffer when ``counts`` is given (as Horovod does
for fused tensors).

Algorithm — vector halving, distance doubling (VHDD), as in the paper and in
Horovod's CPU implementation. At distance ``d = 1, 2, 4, …`` rank ``r`` and
rank ``r ^ d`` hold the same segment of their partial results; the lower rank
keeps the first ``m // 2`` elements, the upper the rest, and each sends the
other the part it does not keep. Both then hold the same slice of the two
vectors to combine, compute the slice's dot product and squared norms in
float64, and sum these three numbers (per tensor) over the ``2d`` ranks that
hold slices of those two vectors (recursive doubling: every member adds the
same two numbers, so all get identical bits). After ``log2(p)`` levels each
rank owns ``1/p`` of the result; the segments then travel back in reverse
order (distance halving) until every rank has all of it. Each rank sends and
receives ``2 (1 - 1/p) n`` elements — like a ring all-reduce — in ``2 log2(p)``
data messages plus ``log2(p) (log2(p) + 1) / 2`` scalar messages of 24 bytes
per tensor. Every slice of the result is computed by exactly one rank and only
copied afterwards, so every rank returns identical bits.

Precision: the data travel and are stored in their own dtype; each level's
combination is computed in float64 and rounded once to that dtype (Horovod's
float32 path does the same; its float16 path uses float32). Dot products and
norms are always accumulated in float64. Narrower arithmetic would overflow on
the coefficients of vectors of very different size (1e-38 against 1e18 gives a
coefficient near 1e56) and round three times per level instead of once.

Messages: every point-to-point message goes over a private duplicate of the
communicator, made on first use (a collective call, reached by every rank at
the same point, like the reduction itself), cached as an MPI attribute of the
communicator and freed with it. Its separate context means its tags
(``_TAG_*``: 1 data halves, 2 scalars, 3 result halves) can never match the
application's messages, whatever tags those use. Calls on one communicator
must not overlap (from several threads), as for any MPI collective.

Ranks must pass arrays of the same size, dtype and ``counts``; this function
does not check (the Communicator's argument check does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .arrays import DtypeSet

__all__ = ["adasum_allreduce"]

_DTYPES = DtypeSet(np.float16, np.float32, np.float64, bf16=True)
_WIRE = {2: np.uint16, 4: np.uint32, 8: np.uint64}  # move raw bits: MPI has no bfloat16 type
_ZERO_NORMSQ = math.sqrt(np.finfo(np.float64).tiny)
_BLOCK = 1 << 16  # elements combined in float64 at a time (bounded scratch memory)
_TAG_SCATTER, _TAG_SCALARS, _TAG_GATHER = 1, 2, 3
_F64 = np.dtype(np.float64)
_keyval: int | None = None


def adasum_allreduce(mpi_comm: Any, x: np.ndarray, *, counts: Sequence[int] | None = None) -> np.ndarray:
    """Return the Adasum reduction of every rank's ``x`` (the same on every rank).

    Args:
        mpi_comm: mpi4py communicator with a power-of-two number of ranks.
        x: float16, bfloat16 (ml_dtypes), float32 or float64 numpy array.
        counts: sizes of the tensors laid end to end in ``x.reshape(-1)``;
            each gets its own dot products and norms. Default: one tensor.

    Returns:
        A new array with ``x``'s dtype and shape.

    Example:
        >>> adasum_allreduce(MPI.COMM_WORLD, np.ones(4, np.float32))  # identical inputs -> the input
    """
    _check_array(x)
    size = mpi_comm.Get_size()
    _check_size(size)
    bounds = _tensor_bounds(counts, x.size)
    out = np.array(x, order="C", copy=True)
    if size == 1 or out.size == 0:
        return out
    flat = out.reshape(-1)
    p2p = _private_comm(mpi_comm)
    rank = mpi_comm.Get_rank()
    path = _reduce_scatter(p2p, rank, size, flat, bounds)
    _gather(p2p, rank, flat, path)
    return out


# ------------------------------------------------------------------ checks
def _check_array(x: Any) -> None:
    """Raise TypeError unless ``x`` is a numpy array of a float dtype Adasum supports."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"adasum_allreduce needs a numpy array, got {type(x).__name__}; convert it (e.g. t.numpy())")
    if x.dtype not in _DTYPES:
        raise TypeError(f"Adasum needs float16, bfloat16, float32 or float64 data, got {x.dtype}; cast first")


def _check_size(size: int) -> None:
    """Raise NotImplementedError unless ``size`` is a power of two."""
    if size & (size - 1):
        raise NotImplementedError(
            f"Adasum needs a power-of-two number of ranks, got {size}; run on 1, 2, 4, 8, ... ranks "
            "(or reduce over a power-of-two sub-communicator), or use op='avg'"
        )


def _tensor_bounds(counts: Sequence[int] | None, n: int) -> np.ndarray:
    """Return the start offsets of the tensors in the flat buffer, with ``n`` appended."""
    if counts is None:
        return np.array([0, n], dtype=np.int64)
    sizes = np.asarray(counts, dtype=np.int64).reshape(-1)
    if sizes.size == 0 or (sizes < 0).any() or int(sizes.sum()) != n:
        raise ValueError(f"counts={list(map(int, sizes))} must be non-negative tensor sizes summing to x.size={n}")
    return np.concatenate(([0], np.cumsum(sizes)))


# --------------------------------------------------------------- messages
def _private_comm(mpi_comm: Any) -> Any:
    """Return the duplicate of ``mpi_comm`` that carries Adasum's messages (made on first use)."""
    global _keyval
    from mpi4py import MPI

    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=_free_private)
    dup = mpi_comm.Get_attr(_keyval)
    if dup is None:
        dup = mpi_comm.Dup()
        mpi_comm.Set_attr(_keyval, dup)
    return dup


def _free_private(comm: Any, keyval: int, dup: Any) -> None:
    """Free the private duplicate when its communicator is freed."""
    from mpi4py import MPI

    try:
        dup.Free()
    except MPI.Exception:  # MPI is shutting down: it releases the duplicate itself
        pass


def _exchange(p2p: Any, send: np.ndarray, recv: np.ndarray, peer: int, tag: int) -> None:
    """Send ``send`` to ``peer`` and receive its message into ``recv``."""
    wire = _WIRE[send.itemsize]
    p2p.Sendrecv(send.view(wire), peer, tag, recv.view(wire), peer, tag)


def _group_sum(p2p: Any, rank: int, d: int, values: np.ndarray) -> np.ndarray:
    """Sum ``values`` over the ``2d`` ranks that share ``rank``'s bits above ``d`` (recursive doubling)."""
    acc = values
    other = np.empty_like(values)
    step = 1
    while step <= d:
        p2p.Sendrecv(acc, rank ^ step, _TAG_SCALARS, other, rank ^ step, _TAG_SCALARS)
        acc = acc + other  # addition commutes, so both partners hold the same bits
        step <<= 1
    return acc


# ----------------------------------------------------------------- phases
def _reduce_scatter(p2p: Any, rank: int, size: int, flat: np.ndarray,
                    bounds: np.ndarray) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Halve and combine level by level; return each level's (distance, kept range, given range)."""
    lo, hi = 0, flat.size
    scratch = np.empty((flat.size + 1) // 2, dtype=flat.dtype)
    path = []
    d = 1
    while d < size:
        mid = lo + (hi - lo) // 2
        upper = bool(rank & d)
        keep, give = ((mid, hi), (lo, mid)) if upper else ((lo, mid), (mid, hi))
        mine, theirs = flat[keep[0]:keep[1]], scratch[:keep[1] - keep[0]]
        _exchange(p2p, flat[give[0]:give[1]], theirs, rank ^ d, _TAG_SCATTER)
        pieces = _pieces(bounds, *keep)
        dot, mine_sq, theirs_sq = _partials(mine, theirs, pieces, len(bounds) - 1)
        left, right = (theirs_sq, mine_sq) if upper else (mine_sq, theirs_sq)
        dot, left, right = _group_sum(p2p, rank, d, np.concatenate((dot, left, right))).reshape(3, -1)
        c_left, c_right = _coefficients(dot, left, right)
        c_mine, c_theirs = (c_right, c_left) if upper else (c_left, c_right)
        _combine(mine, theirs, pieces, c_mine, c_theirs)
        path.append((d, keep, give))
        lo, hi = keep
        d <<= 1
    return path


def _gather(p2p: Any, rank: int, flat: np.ndarray, path: list[tuple[int, tuple[int, int], tuple[int, int]]]) -> None:
    """Send the owned segments back along ``path`` in reverse until every rank has the whole vector."""
    for d, keep, give in reversed(path):
        _exchange(p2p, flat[keep[0]:keep[1]], flat[give[0]:give[1]], rank ^ d, _TAG_GATHER)


# ------------------------------------------------------------- arithmetic
def _pieces(bounds: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Return (tensor, start, stop) of each tensor's part of [lo, hi), relative to lo."""
    first = int(np.searchsorted(bounds, lo, side="right")) - 1
    pieces = []
    t = max(first, 0)
    while t < len(bounds) - 1 and bounds[t] < hi:
        start, stop = max(int(bounds[t]), lo), min(int(bounds[t + 1]), hi)
        if stop > start:
            pieces.append((t, start - lo, stop - lo))
        t += 1
    return pieces


def _partials(a: np.ndarray, b: np.ndarray, pieces: list[tuple[int, int, int]],
              tensors: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return per-tensor a·b, ‖a‖², ‖b‖² of this slice, accumulated in float64."""
    out = np.zeros((3, tensors), dtype=_F64)
    for t, start, stop in pieces:
        out[:, t] = _dot_norms(a[start:stop], b[start:stop])
    return out[0], out[1], out[2]


def _dot_norms(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """Return a·b, a·a and b·b accumulated in float64."""
    # einsum, not np.dot: BLAS would accumulate float32 in float32, and its threads
    # stall when several ranks share the cores (400 ms instead of 1 ms per 1e6 elements
    # measured with 2 ranks on 2 cores). einsum casts in small buffered chunks.
    kw = {} if a.dtype == _F64 else {"dtype": _F64, "casting": "safe"}
    return (float(np.einsum("i,i->", a, b, **kw)), float(np.einsum("i,i->", a, a, **kw)),
            float(np.einsum("i,i->", b, b, **kw)))


def _coefficients(dot: np.ndarray, left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return Adasum's coefficients of the left and right vectors (1 where the other norm is ~zero)."""
    def coeff(normsq: np.ndarray) -> np.ndarray:
        big = normsq >= _ZERO_NORMSQ
        return 1.0 - np.divide(dot, 2.0 * normsq, out=np.zeros_like(dot), where=big)

    return coeff(left), coeff(right)


def _combine(mine: np.ndarray, theirs: np.ndarray, pieces: list[tuple[int, int, int]],
             c_mine: np.ndarray, c_theirs: np.ndarray) -> None:
    """Overwrite ``mine`` with c_mine·mine + c_theirs·theirs per tensor (``theirs`` is scratch)."""
    for t, start, stop in pieces:
        cm, ct = float(c_mine[t]), float(c_theirs[t])
        a, b = mine[start:stop], theirs[start:stop]
        if a.dtype == _F64:  # in place: no temporaries
            a *= cm
            b *= ct
            a += b
            continue
        # Narrower data: float64 arithmetic, rounded once to the data dtype (as Horovod's float
        # path does). A coefficient can exceed float32's range (|a| ~ 1e-38 against |b| ~ 1e18
        # gives ~1e56) and float32 arithmetic would also round three times, not once.
        for s in range(0, a.size, _BLOCK):
            x = a[s:s + _BLOCK].astype(_F64)
            x *= cm
            y = b[s:s + _BLOCK].astype(_F64)
            y *= ct
            x += y
            a[s:s + _BLOCK] = x
