"""Straggler detection: which rank makes the others wait, found from the time each rank spends blocked in commwire.

In synchronous training every rank's step takes as long as the slowest rank's:
a rank with a throttled GPU, a noisy neighbour or a slow disk slows the whole
job, and its own step time looks like everyone else's. What differs is where
the time goes. commwire counts, per thread, the seconds spent blocked in its
collectives and handle waits (``commwire.comm.handle.blocked_seconds``); the
rest of a step is the rank's own work. The ranks that wait for a straggler
block longer; the straggler itself blocks least.

:class:`StragglerMonitor` turns that into scores, in the shape NVIDIA's
resiliency extension reports them: every ``every`` steps one small all-gather
(three numbers per rank) gives each rank's own-work seconds per step; a rank's
**relative score** is the fastest rank's own-work time over its own (1.0 for the
fastest), its **individual score** its own-work time in its best window so far
over the current one (below 1.0: it became slower; a slow first window, warming
up, does not count against later ones). Ranks whose relative score is
below ``threshold`` are reported as stragglers, on every rank alike.

Only the thread that calls :meth:`StragglerMonitor.step` is measured, and only
waits inside commwire count as blocked (a DDP hook's future waited for by torch
does not).

Example:
    >>> mon = commwire.StragglerMonitor(every=100)
    >>> for batch in loader:
    ...     train_step(batch)
    ...     report = mon.step()
    ...     if report is not None and report.stragglers:
    ...         print(report)              # every rank gets the same report
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validate import positive_int
from .handle import blocked_seconds
from .runtime import default_comm

__all__ = ["RankTiming", "StragglerMonitor", "StragglerReport"]


@dataclass(frozen=True)
class RankTiming:
    """One rank's window: steps, wall seconds and seconds blocked in commwire on the measured thread."""

    rank: int
    steps: int
    wall_s: float
    blocked_s: float

    @property
    def work_s(self) -> float:
        """Return the seconds outside commwire's waits: the rank's own work (compute, data, host code)."""
        return max(0.0, self.wall_s - self.blocked_s)

    @property
    def work_ms_per_step(self) -> float:
        """Return the rank's own work per step, in milliseconds."""
        return 1e3 * self.work_s / max(1, self.steps)

    @property
    def blocked_ms_per_step(self) -> float:
        """Return the time blocked in commwire per step, in milliseconds."""
        return 1e3 * self.blocked_s / max(1, self.steps)


@dataclass(frozen=True)
class StragglerReport:
    """The scores of one window, the same on every rank."""

    window: int
    """How many windows came before this one."""
    timings: tuple[RankTiming, ...]
    relative: tuple[float, ...]
    """Per rank: the fastest rank's own-work time per step over this rank's (1.0 = the fastest)."""
    individual: tuple[float, ...]
    """Per rank: its own-work time per step in its best window so far over this window's (< 1: slower now)."""
    threshold: float

    @property
    def stragglers(self) -> list[int]:
        """Return the ranks whose relative score is below the threshold, slowest first."""
        slow = [r for r, score in enumerate(self.relative) if score < self.threshold]
        return sorted(slow, key=lambda r: self.relative[r])

    @property
    def slowest(self) -> int:
        """Return the rank with the most own work per step."""
        return int(np.argmin(self.relative))

    def __str__(self) -> str:
        named = ", ".join(f"rank {r} ({self.relative[r]:.2f})" for r in self.stragglers) or "none"
        lines = [f"commwire stragglers, window {self.window} ({self.timings[0].steps} steps): {named} "
                 f"below relative score {self.threshold:g}",
                 "rank  work ms/step  blocked ms/step  relative  individual"]
        for t, rel, ind in zip(self.timings, self.relative, self.individual):
            lines.append(f"{t.rank:>4}  {t.work_ms_per_step:>12.1f}  {t.blocked_ms_per_step:>15.1f}  "
                         f"{rel:>8.2f}  {ind:>10.2f}")
        return "\n".join(lines)


class StragglerMonitor:
    """Score every rank's own work every ``every`` steps from the time it spends blocked in commwire.

    Args:
        every: steps per window; :meth:`step` returns a report at the end of each (one
            all-gather of 3 numbers per rank then, nothing in between).
        threshold: a rank whose relative score is below it is a straggler (0 < threshold <= 1;
            0.8: its own work takes 25% longer than the fastest rank's).
        comm: communicator whose ranks are compared (default: the world). Every rank of it
            must call :meth:`step` equally often.
    """

    def __init__(self, every: int = 100, threshold: float = 0.8, comm: Any = None) -> None:
        self.every = positive_int("every", every, extra="(steps per window)")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold={threshold} must lie in (0, 1]; 0.8 flags a rank whose own work "
                             "takes 25% longer than the fastest rank's")
        self.threshold = float(threshold)
        self.comm = default_comm(comm)
        self.last: StragglerReport | None = None
        """The latest report (None before the first window ends)."""
        self.windows = 0
        self._best: np.ndarray | None = None
        self.restart()

    def restart(self) -> None:
        """Start a new window now (e.g. after evaluation or a checkpoint that should not count)."""
        self._steps = 0
        self._wall0 = time.perf_counter()
        self._blocked0 = blocked_seconds()

    def step(self) -> StragglerReport | None:
        """Count one step; at the end of a window, exchange the timings and return the report (else None)."""
        self._steps += 1
        if self._steps < self.every:
            return None
        return self.report()

    def report(self) -> StragglerReport:
        """End the window now (a collective: every rank calls it) and return its report."""
        mine = np.array([[self._steps, time.perf_counter() - self._wall0, blocked_seconds() - self._blocked0]],
                        dtype=np.float64)
        rows = np.asarray(self.comm.allgather(mine, name="commwire.stragglers")).reshape(-1, 3)
        self.restart()  # after the exchange: its own wait belongs to no window
        timings = tuple(RankTiming(rank=r, steps=int(s), wall_s=float(w), blocked_s=float(b))
                        for r, (s, w, b) in enumerate(rows))
        work = np.array([t.work_s / max(1, t.steps) for t in timings])
        floor = 1e-9  # a rank with no own work at all (a test's empty loop) scores as the fastest
        relative = tuple(float(x) for x in np.maximum(work.min(), floor) / np.maximum(work, floor))
        self._best = work if self._best is None else np.minimum(self._best, work)
        individual = tuple(float(x) for x in np.maximum(self._best, floor) / np.maximum(work, floor))
        self.last = StragglerReport(window=self.windows, timings=timings, relative=relative,
                                    individual=individual, threshold=self.threshold)
        self.windows += 1
        return self.last
