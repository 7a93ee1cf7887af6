"""LocalSync: K local steps, then one average of pseudo-gradients and an outer step (local SGD, DiLoCo).

Every rank keeps a reference copy θ_ref of the weights (identical on all
ranks). Between synchronisations each rank trains its own copy; on every K-th
step the pseudo-gradients Δ_m = θ_ref − θ_m travel in one fused all-reduce per
dtype, the outer step updates θ_ref and every rank restarts from it:

    Δ = avg_m(Δ_m);  b = μ·b + Δ;  θ_ref −= outer_lr · (Δ + μ·b if nesterov else b)

outer_lr = 1, μ = 0 is plain parameter averaging (local SGD / local Adam);
outer_lr = 0.7, μ = 0.9, Nesterov is DiLoCo's outer optimizer. Optimizer
states named by the caller (moments, error-feedback buffers) can be averaged
at the same sync in a second fused message. While every rank holds the same
weights anyway (a DDP warm-up), :meth:`LocalSync.rebase` ends a period
without a message. A caller with its own outer optimizer (``DiLoCo``'s
``outer_optimizer=``) calls :meth:`LocalSync.average` and steps θ_ref itself.

Arrays are numpy arrays or torch tensors (one kind per schedule); only
operators, slicing and the Communicator are used, so the same code serves both.
A torch caller runs :meth:`LocalSync.sync` under ``torch.no_grad()``.

Example:
    >>> sched = LocalSync(model_named_params, LocalSyncConfig(sync_every=32, outer_lr=0.7, outer_momentum=0.9))
    >>> for step in range(steps):
    ...     local_update(...)
    ...     if sched.tick():
    ...         sched.sync()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validate import positive_int
from ..comm.arrays import copy, nbytes, zeros_like
from ..comm.communicator import Communicator
from ..comm.runtime import default_comm
from .base import Ticker, check_step, fused_average, fused_bytes

__all__ = ["LocalSync", "LocalSyncConfig", "check_identical"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalSyncConfig:
    """When to synchronise, how to apply the averaged pseudo-gradient and what carries it."""

    sync_every: int = 32
    """K: local steps between synchronisations (1 = every step)."""
    outer_lr: float = 1.0
    """Outer learning rate (1 with no momentum = plain averaging)."""
    outer_momentum: float = 0.0
    """Outer momentum μ (DiLoCo: 0.9)."""
    nesterov: bool = True
    """Use Nesterov's form of the outer momentum (ignored when μ = 0)."""
    codec: Any = None
    """Wire format of the pseudo-gradients: None/"none", a spec like "fp8-e4m3", or a codec object."""
    state_codec: Any = None
    """Wire format of averaged optimizer states (default: uncompressed)."""

    def __post_init__(self) -> None:
        positive_int("sync_every", self.sync_every, extra="(1 syncs every step)")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr={self.outer_lr} must be > 0 (1.0 = plain averaging)")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum={self.outer_momentum} must lie in [0, 1) (DiLoCo uses 0.9)")


def _fingerprint(x: Any) -> int:
    import zlib

    host = x if isinstance(x, np.ndarray) else x.detach().cpu().contiguous().numpy()
    return zlib.crc32(np.ascontiguousarray(host).view(np.uint8).reshape(-1).data)


def check_identical(named: Sequence[tuple[str, Any]], comm: Communicator) -> None:
    """Raise ValueError on every rank if any array differs between ranks (CRC32 allgather)."""
    mine = [_fingerprint(x) for _, x in named]
    everyone = comm.allgather_object(mine)
    for i, (name, _) in enumerate(named):
        values = [hashes[i] for hashes in everyone]
        if len(set(values)) > 1:
            differ = [r for r, h in enumerate(values) if h != values[0]]
            raise ValueError(f"parameter {name!r} differs between ranks at the start (ranks {differ} differ from "
                             "rank 0); broadcast the model first, e.g. "
                             "commwire.torch.broadcast_parameters(model.state_dict(), root_rank=0)")


class LocalSync(Ticker):
    """Average pseudo-gradients every K steps and apply the outer step to the reference weights.

    Args:
        params: ``(name, array)`` pairs, the live weights (numpy arrays or torch
            tensors), identical on every rank now.
        config: the schedule settings.
        comm: communicator (default: the world).
        states: ``(name, array)`` pairs giving the names and shapes of optimizer
            states to average at each sync (the arrays themselves are passed to
            :meth:`sync`, since an optimizer may replace them, e.g. on load).
        check: verify that ``params`` are identical on every rank.
        overlap: move the pseudo-gradients on the communicator's background lane between
            :meth:`begin` and :meth:`finish` (Streaming DiLoCo's delayed syncs); False: move them
            when :meth:`finish` waits.
    """

    def __init__(self, params: Sequence[tuple[str, Any]], config: LocalSyncConfig | None = None, *,
                 comm: Communicator | None = None, states: Sequence[tuple[str, Any]] = (),
                 check: bool = True, overlap: bool = False) -> None:
        self.comm = comm = default_comm(comm)
        self.config = config if config is not None else LocalSyncConfig()
        self.params = list(params)
        if not self.params:
            raise ValueError("LocalSync needs at least one parameter; got an empty list")
        if check:
            check_identical(self.params, comm)
        self.reference = {name: copy(x) for name, x in self.params}
        self.momentum = ({name: zeros_like(x) for name, x in self.params}
                         if self.config.outer_momentum > 0 else {})
        self._pseudo = fused_average(self.params, comm, self.config.codec, overlap=overlap)
        self._delta: dict[str, Any] | None = None  # the averaged pseudo-gradient, once waited for
        self.state_names = [name for name, _ in states]
        self._states = fused_average(list(states), comm, self.config.state_codec)
        self.steps = 0
        self.syncs = 0

    # --------------------------------------------------------------- schedule
    def due(self, step: int) -> bool:
        """Return whether local step ``step`` (counting from 1) ends with :meth:`sync`: every K-th does."""
        return check_step(step) % self.config.sync_every == 0

    def sync(self, states: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Average pseudo-gradients (and ``states`` in place), take the outer step, reset the weights.

        Returns:
            ``{name: averaged pseudo-gradient}`` as views valid until the next sync.
        """
        delta = self.average(states)
        self.outer_step(delta)
        return delta

    def average(self, states: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Average the pseudo-gradients θ_ref − θ (and ``states`` in place) over the ranks; count the sync.

        The first half of :meth:`sync`, for a caller that applies its own outer
        step to :attr:`reference` (and then copies it into the weights).

        Returns:
            ``{name: averaged pseudo-gradient}`` as views valid until the next sync.
        """
        self.begin()
        return self.finish(states)

    def begin(self) -> None:
        """Start averaging θ_ref − θ as the weights are now; :meth:`finish` completes it.

        With ``overlap=True`` the message moves on the background lane while the caller
        trains on; the weights may change in between (the pseudo-gradient was copied).
        """
        if self.in_flight:
            raise RuntimeError("begin() was called twice without finish(); finish the sync in flight first")
        for name, x in self.params:
            slot = self._pseudo.view(name)
            slot[...] = self.reference[name]
            slot -= x
            self._pseudo.mark(name)

    @property
    def codec(self) -> Any:
        """Return the codec object of the pseudo-gradients (None uncompressed)."""
        return self._pseudo.codec

    @property
    def in_flight(self) -> bool:
        """Return whether a sync was begun and not yet finished."""
        return self._delta is not None or self._pseudo.in_flight() > 0

    def collect(self) -> dict[str, Any] | None:
        """Wait for the sync in flight (if any) and return its averaged pseudo-gradient without applying it."""
        if self._delta is None and self._pseudo.in_flight():
            self._delta = self._pseudo.wait()
        return self._delta

    def finish(self, states: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Wait for the sync :meth:`begin` started, average ``states`` in place, count it; return the average."""
        delta = self.collect()
        if delta is None:
            raise RuntimeError("finish() was called without begin(); begin a sync first")
        self._delta = None
        if self._states is not None:
            self._average_states(states or {})
        self.syncs += 1
        return delta

    def abandon(self) -> None:
        """Forget a sync in flight whose communicator failed; θ_ref is unchanged, so the next sync carries it."""
        self._delta = None
        self._pseudo.discard()

    def outer_step(self, delta: Mapping[str, Any], alpha: float = 0.0) -> None:
        """Apply the configured outer SGD step to :attr:`reference` and restart every rank's weights from it.

        ``alpha`` > 0 keeps that share of the local weights (Streaming DiLoCo's mixing):
        θ = (1 − α)·θ_ref + α·θ.
        """
        cfg = self.config
        for name, x in self.params:
            d, ref = delta[name], self.reference[name]
            if cfg.outer_momentum > 0:
                buf = self.momentum[name]
                buf *= cfg.outer_momentum
                buf += d
                ref -= cfg.outer_lr * (d + cfg.outer_momentum * buf if cfg.nesterov else buf)
            elif cfg.outer_lr == 1.0:
                ref -= d
            else:
                ref -= cfg.outer_lr * d
        self.restart(alpha)

    def restart(self, alpha: float = 0.0) -> None:
        """Set the weights to θ_ref (``alpha`` = 0) or to (1 − α)·θ_ref + α·θ."""
        for name, x in self.params:
            ref = self.reference[name]
            if alpha == 0.0:
                x[...] = ref
            else:
                x *= alpha
                x += (1.0 - alpha) * ref

    def rebase(self) -> dict[str, Any]:
        """Return θ_ref − θ without communicating and restart the reference from θ (no outer step).

        For phases in which every rank already holds the same weights (a DDP
        warm-up averages gradients every step): the averaged pseudo-gradient is
        then the local one, so a sync would send bytes to learn nothing.

        Returns:
            ``{name: pseudo-gradient}`` as views valid until the next sync or rebase.
        """
        delta = {}
        for name, x in self.params:
            slot = self._pseudo.view(name)  # the fused buffer is scratch space between syncs
            slot[...] = self.reference[name]
            slot -= x
            self.reference[name][...] = x
            delta[name] = slot
        return delta

    def _average_states(self, states: Mapping[str, Any]) -> None:
        missing = [n for n in self.state_names if n not in states]
        if missing:
            raise ValueError(f"sync() needs the states registered at construction; missing {missing[:3]}")
        for name in self.state_names:
            self._states.view(name)[...] = states[name]
            self._states.mark(name)
        averaged = self._states.wait()
        for name in self.state_names:
            states[name][...] = averaged[name]

    # -------------------------------------------------------------- accounting
    @property
    def values_per_sync(self) -> int:
        """Return how many numbers one sync all-reduces (pseudo-gradients plus averaged states)."""
        return sum(sum(b.numels) for fb in (self._pseudo, self._states) if fb is not None for b in fb.buckets)

    @property
    def bytes_per_sync(self) -> int:
        """Return the bytes one sync hands to MPI on this rank (the counters' ``bytes``), by formula."""
        return fused_bytes(self._pseudo, self.config.codec) + fused_bytes(self._states, self.config.state_codec)

    @property
    def bytes_per_period(self) -> int:
        """Return the bytes of one period of ``sync_every`` steps: one sync."""
        return self.bytes_per_sync

    @property
    def messages_per_sync(self) -> int:
        """Return the number of collectives one sync issues."""
        return sum(len(fb.buckets) for fb in (self._pseudo, self._states) if fb is not None)

    def state_bytes(self) -> int:
        """Return the bytes of optimizer state the schedule holds: reference weights and outer momentum."""
        return sum(nbytes(a) for a in list(self.reference.values()) + list(self.momentum.values()))

    def buffer_bytes(self) -> int:
        """Return the bytes of the fused send/receive buffers (transient, reused at every sync)."""
        return sum(nbytes(b.buffer) for fb in (self._pseudo, self._states) if fb is not None for b in fb.buckets)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return copies of the reference weights, outer momentum, counters and codec state.

        A sync in flight is waited for first: its averaged pseudo-gradient is saved
        (``"pending"``), and :meth:`finish` after a load returns it without communicating.
        """
        pending = self.collect()
        return {
            "pending": None if pending is None else {n: copy(x) for n, x in pending.items()},
            "steps": self.steps,
            "syncs": self.syncs,
            "reference": {n: copy(x) for n, x in self.reference.items()},
            "momentum": {n: copy(x) for n, x in self.momentum.items()},
            "codec": self._pseudo.state_dict(),
            "state_codec": self._states.state_dict() if self._states is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (same parameter names and shapes)."""
        saved = set(state["reference"])
        if saved != set(self.reference):
            extra, missing = sorted(saved - set(self.reference)), sorted(set(self.reference) - saved)
            raise ValueError(f"checkpoint parameters differ from this schedule's: unexpected {extra[:3]}, "
                             f"missing {missing[:3]}; build the optimizer over the same model")
        if bool(state["momentum"]) != bool(self.momentum):
            raise ValueError("checkpoint and schedule disagree on outer momentum (one has it, the other not); "
                             "use the same outer_momentum to resume")
        for group in ("reference", "momentum"):
            mine = getattr(self, group)
            for name, value in state[group].items():
                mine[name][...] = value
        self.steps = int(state["steps"])
        self.syncs = int(state["syncs"])
        self.collect()  # a sync in flight here finishes first: the lane may still use the codec's state
        self._pseudo.discard()
        pending = state.get("pending")
        self._delta = None if pending is None else {n: copy(x) for n, x in pending.items()}
        self._pseudo.load_state_dict(state["codec"])
        if self._states is not None and state.get("state_codec") is not None:
            self._states.load_state_dict(state["state_codec"])
