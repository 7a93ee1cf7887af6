"""EveryStep: average the gradients at every step (plain data parallelism).

The policy ``DistributedOptimizer`` follows, as a schedule on named arrays
(numpy arrays or torch tensors): every step's gradients travel in one fused
all-reduce per dtype and device (any codec), and every rank then applies the
same averaged gradients. A gradient a rank does not have travels as zeros, so
every rank receives every average.

Example:
    >>> sched = EveryStep(model_named_params)
    >>> for step in range(steps):
    ...     grads = local_gradients(...)
    ...     if sched.tick():
    ...         grads = sched.sync(grads)
    ...     apply(grads)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..comm.communicator import Communicator
from ..comm.runtime import default_comm
from .base import Ticker, check_step, fused_average, fused_bytes

__all__ = ["EveryStep"]


class EveryStep(Ticker):
    """Average named gradients over the ranks at every step, in one fused all-reduce per dtype and device.

    Args:
        params: ``(name, array)`` pairs giving the names, shapes, dtypes and devices
            of the gradients (the parameters themselves, numpy arrays or torch tensors).
        comm: communicator (default: the world).
        codec: wire format of the gradients: None/"none", a spec like "ef+fp8-e4m3", or a codec object.
    """

    def __init__(self, params: Sequence[tuple[str, Any]], *, comm: Communicator | None = None,
                 codec: Any = None) -> None:
        self.comm = comm = default_comm(comm)
        self.params = list(params)
        if not self.params:
            raise ValueError("EveryStep needs at least one parameter; got an empty list")
        self.codec = codec
        self._names = {name for name, _ in self.params}
        self._grads = fused_average(self.params, comm, codec)
        self.steps = 0
        self.syncs = 0

    def due(self, step: int) -> bool:
        """Return True: every step (counting from 1) communicates."""
        check_step(step)
        return True

    def sync(self, grads: Mapping[str, Any]) -> dict[str, Any]:
        """Average ``{name: gradient}`` over the ranks; return the averages as views valid until the next sync."""
        unknown = [n for n in grads if n not in self._names]
        if unknown:
            raise KeyError(f"sync() got gradients of unregistered parameters {unknown[:3]}; "
                           "pass the same names EveryStep was built with")
        for name, _ in self.params:
            g = grads.get(name)
            if g is not None:
                self._grads.add(name, g)
        averaged = self._grads.wait()  # flushes: a missing gradient travels as zeros
        self.syncs += 1
        return averaged

    # -------------------------------------------------------------- accounting
    @property
    def bytes_per_sync(self) -> int:
        """Return the bytes one sync hands to MPI on this rank (the counters' ``bytes``), by formula."""
        return fused_bytes(self._grads, self.codec)

    @property
    def messages_per_sync(self) -> int:
        """Return the number of collectives one sync issues (one per dtype and device)."""
        return len(self._grads.buckets)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the counters and the codec state (error-feedback residuals)."""
        return {"steps": self.steps, "syncs": self.syncs, "codec": self._grads.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.steps = int(state["steps"])
        self.syncs = int(state["syncs"])
        self._grads.load_state_dict(state["codec"])
