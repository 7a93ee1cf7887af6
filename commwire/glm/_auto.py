"""Choose CA-SGD's s at fit time (s="auto") from the measured link and the measured local work.

The cost model is :mod:`commwire.costmodel`: all-reduces of each candidate's
payload, timed on the ranks that will train, fix α, α_large and β (``fit_link``
picks the tbf or the plain link shape); the loop's own local work per exchange
(gather, Gram, recurrence, update) is timed for each candidate by running the
training engine over a communicator that sends nothing. The choice is the
smallest s whose modelled time per inner step (``casgd_step_seconds``) is within
``MARGIN`` of the least: the model's error is of the order of the gaps between
neighbouring candidates, and a larger s sends more bytes per step (the Gram adds
(s-1)/2 b^2 numbers a step) and holds a larger panel, so it has to win clearly.

Every rank measures, the measurements are reduced with MAX (the slowest rank sets
the pace), and rank 0's choice is broadcast, so all ranks run the same s.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import numpy as np

from .. import costmodel

__all__ = ["AutoS", "CANDIDATES", "MARGIN", "MAX_ROWS", "NO_COMM", "candidates", "choose"]

CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
"""The s values "auto" chooses from (s = 1 is plain SGD's one exchange per step)."""
MAX_ROWS = 512
"""Largest s*b "auto" considers: the panel product grows as (s*b)^2 and pays only while messages cost more."""
_ROUNDS = 3
"""Timed rounds per measurement (the smallest per-exchange work, the median all-reduce)."""
MEASURED_BYTES = 256 << 10
"""Largest payload whose all-reduce is timed; larger ones are predicted by the fitted model (cheap on slow links)."""
_TARGET_S = 5e-4
"""Aim of each timed batch: long enough to average out the clock and the shortest calls."""
_MAX_CALLS = 64
MARGIN = 0.20
"""A larger s is chosen only when modelled this much faster per inner step than every smaller one."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AutoS:
    """Record how s="auto" chose s: the candidates, what was measured and what the model predicted."""

    s: int
    """The chosen inner steps per exchange (the same on every rank)."""
    candidates: tuple[int, ...]
    """The s values considered."""
    step_s: tuple[float, ...]
    """Modelled seconds per inner step of each candidate."""
    compute_s: tuple[float, ...]
    """Measured local work per exchange of each candidate (slowest rank)."""
    allreduce_s: tuple[float, ...]
    """Measured all-reduce of each candidate's payload (slowest rank; nan: over MEASURED_BYTES, predicted;
    empty on one rank)."""
    link: Any
    """The fitted commwire.costmodel.LinkModel (None on one rank)."""
    tune_s: float
    """Wall time this rank spent choosing."""
    allreduces: int
    """All-reduces the measurement issued (counted in commwire.stats(), not in FitResult.n_exchanges)."""


class _NoComm:
    """Stand in for the communicator while timing local work: the all-reduce is left out."""

    size, rank = 1, 0

    def allreduce(self, x: Any, op: str = "sum", *, out: Any = None, name: str | None = None) -> Any:
        return x if out is None else out


NO_COMM = _NoComm()


def candidates(b: int, m: int) -> tuple[int, ...]:
    """Return the s values considered for batches of b rows out of m: s*b at most min(m, MAX_ROWS), s = 1 always."""
    limit = min(m, MAX_ROWS)
    return tuple(s for s in CANDIDATES if s == 1 or s * b <= limit)


def _time_local(work: Callable[[int, int], float], s: int) -> float:
    """Return the least seconds per exchange of ``_ROUNDS`` timed batches of the loop's local work at s."""
    first = work(s, 1)  # also the warm-up: pages, caches, compiled kernels
    exchanges = max(1, min(_MAX_CALLS, math.ceil(_TARGET_S / max(first, 1e-7))))
    return min(work(s, exchanges) for _ in range(_ROUNDS))


def _time_candidates(work: Callable[[int, int], float], cands: tuple[int, ...], step: Callable[[int, float], float],
                     ) -> list[float]:
    """Time the local work of each candidate in increasing s; stop once it alone outlasts the best step.

    Past the few s where the loop's fixed cost per exchange is being spread out, the
    work per inner step grows with s (the Gram row of step j is j*b wide). So once a
    candidate's work per step both grew over the previous one's and exceeds the best
    modelled step time so far, no larger s can win: those are left unmeasured (inf),
    which saves the costliest timings.
    """
    out: list[float] = []
    best, previous, current = math.inf, math.inf, math.inf
    for s in cands:
        if current > best and current >= previous:
            out.append(math.inf)
            continue
        c = _time_local(work, s)
        out.append(c)
        previous, current = current, c / s
        best = min(best, step(s, c))
    return out


def _time_allreduces(comm: Any, sizes: list[int], dtype: Any, xp: Any = np) -> tuple[np.ndarray, int]:
    """Return the median seconds of an all-reduce of each size (numbers of dtype, arrays of xp) and the calls made.

    Call counts are agreed from a MAX-reduced warm-up, so every rank issues the same
    collectives; batches of each size are interleaved over ``_ROUNDS`` rounds so a
    load burst from another process hits all sizes alike.
    """
    buf = xp.zeros(max(sizes), dtype=dtype)  # the training payload's kind: device arrays pay their staging
    views = [buf[:n] for n in sizes]
    calls = 0
    warm = np.zeros(len(sizes))
    for i, view in enumerate(views):
        comm.allreduce(view, op="sum", out=view)  # the first call of a shape also agrees on it
        start = time.perf_counter()
        comm.allreduce(view, op="sum", out=view)
        warm[i] = time.perf_counter() - start
        calls += 2
    comm.allreduce(warm, op="max", out=warm)
    calls += 1
    reps = [max(2, min(_MAX_CALLS, math.ceil(_TARGET_S / max(t, 1e-7)))) for t in warm]
    samples = np.zeros((_ROUNDS, len(sizes)))
    for r in range(_ROUNDS):
        for i, (view, k) in enumerate(zip(views, reps)):
            start = time.perf_counter()
            for _ in range(k):
                comm.allreduce(view, op="sum", out=view)
            samples[r, i] = (time.perf_counter() - start) / k
            calls += k
    return np.median(samples, axis=0), calls


def _link(p: int, nbytes: list[int], seconds: list[float]) -> Any:
    """Fit the link model to the all-reduce samples; without a visible bandwidth, a latency-only link."""
    samples = [(p, float(n), t) for n, t in zip(nbytes, seconds)]
    try:
        return costmodel.fit_link(samples)
    except ValueError:
        # The times do not grow with size: bytes are free at these sizes, latency is all.
        per_round = [t / max(1, len(costmodel.rounds(n, p))) for _, n, t in samples]
        return costmodel.LinkModel(alpha=float(np.median(per_round)), beta=1e-15)


def choose(comm: Any, b: int, m: int, comm_dtype: Any, work: Callable[[int, int], float], xp: Any = np) -> AutoS:
    """Measure and choose s for batches of b rows out of m on ``comm``; every rank gets the same s.

    Args:
        comm: the training Communicator (the all-reduces are timed on it).
        b, m: batch size and rows.
        comm_dtype: dtype of the training all-reduce payload.
        work: work(s, k) -> seconds per exchange of k exchanges of the loop's local work at s.
        xp: the array module of the training payload (numpy or cupy).
    """
    start = time.perf_counter()
    cands = candidates(b, m)
    dtype = np.dtype(comm_dtype)
    if len(cands) == 1:
        return AutoS(s=cands[0], candidates=cands, step_s=(math.nan,), compute_s=(math.nan,), allreduce_s=(),
                     link=None, tune_s=time.perf_counter() - start, allreduces=0)
    calls, sizes = 0, [costmodel.sstep_words(s, b) for s in cands]
    if comm.size > 1:
        # The slowest rank sets the pace: times are MAX-reduced, identical on every rank.
        timed = [n for n in sizes if n * dtype.itemsize <= MEASURED_BYTES] or sizes[:2]
        agreed, calls = _time_allreduces(comm, timed, dtype, xp)
        comm.allreduce(agreed, op="max", out=agreed)
        link = _link(comm.size, [n * dtype.itemsize for n in timed], agreed.tolist())
        measured = agreed.tolist() + [math.nan] * (len(sizes) - len(timed))
    else:
        measured, link = [], costmodel.LinkModel(alpha=0.0, beta=1.0)  # one rank: no message is sent

    def step(s: int, c: float) -> float:
        return costmodel.casgd_step_seconds(link, comm.size, b, s, c, dtype.itemsize)

    compute = np.array(_time_candidates(work, cands, step))
    if comm.size > 1:
        comm.allreduce(compute, op="max", out=compute)
        calls += 2
    best, per_step = costmodel.choose_s(link, comm.size, b, dict(zip(cands, compute.tolist())), dtype.itemsize,
                                        margin=MARGIN)
    if comm.size > 1:
        best = int(comm.broadcast_object(best if comm.rank == 0 else None, root=0))
    return AutoS(s=best, candidates=cands, step_s=tuple(per_step[s] for s in cands),
                 compute_s=tuple(compute.tolist()), allreduce_s=tuple(measured),
                 link=None if comm.size == 1 else link, tune_s=time.perf_counter() - start, allreduces=calls)
