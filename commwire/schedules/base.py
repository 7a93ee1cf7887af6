"""The contract every schedule keeps, and the fused all-reduce the averaging schedules share.

A schedule decides *when* a training loop communicates and knows what one
communication costs. Four policies implement :class:`Schedule`:
:class:`~commwire.schedules.EveryStep` (every step), :class:`~commwire.schedules.LocalSync`
(every K-th step), :class:`~commwire.schedules.SStepGram` (the first step of every
group of s) and :class:`~commwire.schedules.LoRDOSchedule` (every K-th step, every
step of a warm-up, and the first step when it seeds its bases).

What differs is the message itself (averaged gradients, pseudo-gradients, a Gram
payload), so each schedule keeps its own method for it (``sync``, ``exchange``,
``step``); the contract covers what a loop, a benchmark or a checkpoint asks of
any of them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from .._validate import positive_int
from ..comm.communicator import Communicator
from ..fusion import FusionBuffer

__all__ = ["Schedule", "Ticker", "check_step", "fused_average", "fused_bytes", "wire_bytes"]


@runtime_checkable
class Schedule(Protocol):
    """Which steps communicate, what one synchronisation costs, and a checkpoint of the counters."""

    @property
    def steps(self) -> int:
        """Return the steps counted so far."""

    @property
    def syncs(self) -> int:
        """Return the synchronisations (messages of ``bytes_per_sync``) made so far."""

    def due(self, step: int) -> bool:
        """Return whether step ``step`` (counting from 1) communicates."""

    @property
    def bytes_per_sync(self) -> int:
        """Return the bytes one synchronisation hands to MPI on this rank (what ``commwire.stats()`` counts)."""

    @property
    def messages_per_sync(self) -> int:
        """Return the collectives one synchronisation issues."""

    def state_dict(self) -> dict[str, Any]:
        """Return the state a checkpoint needs to resume the schedule exactly."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class Ticker:
    """Count the steps of a schedule that a training loop drives: ``if sched.tick(): <communicate>``."""

    steps: int

    def due(self, step: int) -> bool:
        """Return whether step ``step`` (counting from 1) communicates."""
        raise NotImplementedError

    def tick(self) -> bool:
        """Count one step; return whether it communicates."""
        self.steps += 1
        return self.due(self.steps)


def check_step(step: int) -> int:
    """Return ``step`` if it is a step number (an int >= 1), else raise ValueError."""
    return positive_int("step", step, extra="(steps count from 1)")


def wire_bytes(codec: Any, nbytes: int, itemsize: int) -> int:
    """Return the bytes one all-reduce of ``nbytes`` hands to MPI with ``codec`` (by formula)."""
    if codec is None or codec == "none":
        return int(nbytes)
    from ..codecs.collective import resolve_codec

    c = resolve_codec(codec)
    if c.lossless:
        return int(nbytes)
    # Lossy payloads are counted as one encoded tensor; the pipelined collective adds one
    # scale per chunk for per-tensor-scaled formats (4 bytes x ranks x segments at most).
    return int(c.wire_nbytes(nbytes // itemsize))


def fused_average(named: Sequence[tuple[str, Any]], comm: Communicator, codec: Any,
                  overlap: bool = False) -> FusionBuffer | None:
    """Return a FusionBuffer that averages ``named`` in one all-reduce per dtype and device (None if empty).

    ``overlap=False`` moves the buckets when waited for (a schedule that communicates between
    steps has no backward pass to overlap with); True moves them on the background lane (a
    sync that stays in flight while the next steps compute).
    """
    if not named:
        return None
    # No size limit and no small first bucket: the fewest messages.
    return FusionBuffer(list(named), comm=comm, op="avg", codec=codec, threshold_bytes=sys.maxsize,
                        first_bucket_bytes=0, overlap="lane" if overlap else False)


def fused_bytes(fb: FusionBuffer | None, codec: Any) -> int:
    """Return the bytes one round of ``fb`` hands to MPI with ``codec`` (0 for None), by formula."""
    if fb is None:
        return 0
    return sum(wire_bytes(codec, b.nbytes, b.nbytes // max(1, sum(b.numels))) for b in fb.buckets)
