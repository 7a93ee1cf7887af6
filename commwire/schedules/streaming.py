"""StreamingSync: DiLoCo's sync split into fragments that take turns, each in flight while training goes on.

Streaming DiLoCo (Douillard et al., 2025, arXiv:2501.18512; torchft's ``DiLoCo``
with ``model_fragments``) cuts the parameters into P fragments. In each period of
H = ``sync_every`` steps every fragment syncs once, at its own step: fragment i
(counting from 0) is applied after steps (i + 1)·H/P + k·H, so one sync carries
about 1/P of the model and the peak bandwidth falls P-fold. Its pseudo-gradient
θ_ref − θ is taken ``delay`` (τ < H/P) steps earlier and moves on the
communicator's background lane while those τ steps compute. When it arrives the
outer step updates the fragment's θ_ref, and the weights restart from
(1 − α)·θ_ref + α·θ (``alpha``: the share of the local progress kept; torchft's
``fragment_update_alpha``, the paper's mixing factor). With P = 1, τ = 0, α = 0
this is :class:`~commwire.schedules.LocalSync` exactly.

Each fragment is a :class:`LocalSync` over its parameters (its own θ_ref, outer
momentum, fused buffer and codec state); this class decides which fragment
begins and finishes at each step. A caller with its own outer optimizer passes
``outer=`` to :meth:`StreamingSync.sync`.

Example:
    >>> sched = StreamingSync(model_named_params, LocalSyncConfig(sync_every=32, outer_lr=0.7, outer_momentum=0.9),
    ...                       fragments=4, delay=2, alpha=0.5)
    >>> for step in range(steps):
    ...     local_update(...)
    ...     if sched.tick():
    ...         sched.sync()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._validate import positive_int
from ..comm.communicator import Communicator
from ..comm.runtime import default_comm
from .base import Ticker, check_step
from .local import LocalSync, LocalSyncConfig, check_identical

__all__ = ["StreamingSync", "split_fragments"]


def split_fragments(named: Sequence[tuple[str, Any]], fragments: int | Sequence[Sequence[str]]) -> list[list[str]]:
    """Return the parameter names of each fragment.

    Args:
        named: ``(name, array)`` pairs in model order.
        fragments: P, a number of fragments (consecutive parameters, cut where each holds
            about 1/P of the elements), or the fragments themselves as lists of names
            (each parameter in exactly one; e.g. a strided split by layer).
    """
    names = [n for n, _ in named]
    if isinstance(fragments, (int, np.integer)) and not isinstance(fragments, bool):
        count = positive_int("fragments", int(fragments), extra="(1 syncs the whole model at once)")
        if count > len(names):
            raise ValueError(f"fragments={count} is more than the {len(names)} parameters; "
                             f"use at most {len(names)} or give the fragments as lists of names")
        sizes = np.array([int(np.prod(tuple(x.shape), dtype=np.int64)) for _, x in named], dtype=np.float64)
        ends = np.cumsum(sizes) / max(1.0, sizes.sum())
        cuts = [0]
        for k in range(1, count):  # the first parameter whose cumulative share reaches k/P ends fragment k-1
            cut = int(np.searchsorted(ends, k / count - 1e-12)) + 1
            cuts.append(min(max(cut, cuts[-1] + 1), len(names) - (count - k)))
        cuts.append(len(names))
        return [names[a:b] for a, b in zip(cuts, cuts[1:])]
    if isinstance(fragments, (str, bytes)) or not isinstance(fragments, Sequence):
        raise TypeError(f"fragments must be an int (how many) or a list of lists of parameter names, "
                        f"got {type(fragments).__name__} {fragments!r}")
    for i, g in enumerate(fragments):
        if isinstance(g, (str, bytes)) or not isinstance(g, Iterable):
            raise TypeError(f"fragments[{i}] is {type(g).__name__} {g!r}, not a list of parameter names; "
                            "give one list per fragment, e.g. [['0.weight', '0.bias'], ['2.weight']]")
    groups = [list(g) for g in fragments]
    if not groups or any(not g for g in groups):
        raise ValueError("fragments must be non-empty lists of parameter names; an empty fragment would never sync")
    seen: dict[str, int] = {}
    known = set(names)
    for i, group in enumerate(groups):
        for name in group:
            if not isinstance(name, str):
                raise TypeError(f"fragments[{i}] holds {type(name).__name__} {name!r}; give parameter names")
            if name not in known:
                raise ValueError(f"fragments[{i}] names {name!r}, which is not a parameter here "
                                 f"(first parameters: {names[:3]})")
            if name in seen:
                raise ValueError(f"parameter {name!r} is in fragments {seen[name]} and {i}; put it in one")
            seen[name] = i
    missing = [n for n in names if n not in seen]
    if missing:
        raise ValueError(f"{len(missing)} parameters are in no fragment (first: {missing[:3]}); "
                         "every parameter must be in exactly one")
    return groups


class StreamingSync(Ticker):
    """Sync P fragments of the parameters in turn, each delayed by ``delay`` steps and mixed by ``alpha``.

    Args:
        params: ``(name, array)`` pairs, the live weights, identical on every rank now.
        config: the schedule settings; ``sync_every`` (H) is the period in which every fragment
            syncs once and must be a multiple of the number of fragments.
        fragments: P, or lists of parameter names (see :func:`split_fragments`).
        delay: τ, the steps a fragment's sync stays in flight (0 <= τ < H/P); τ > 0 moves it on
            the communicator's background lane meanwhile.
        alpha: the share of the local weights kept when a fragment's sync lands (0 <= α <= 1).
        comm: communicator (default: the world).
        check: verify that ``params`` are identical on every rank.
    """

    def __init__(self, params: Sequence[tuple[str, Any]], config: LocalSyncConfig | None = None, *,
                 fragments: int | Sequence[Sequence[str]] = 1, delay: int = 0, alpha: float = 0.0,
                 comm: Communicator | None = None, check: bool = True) -> None:
        self.comm = comm = default_comm(comm)
        self.config = config if config is not None else LocalSyncConfig()
        self.params = list(params)
        if not self.params:
            raise ValueError("StreamingSync needs at least one parameter; got an empty list")
        self.fragments = split_fragments(self.params, fragments)
        count, period = len(self.fragments), self.config.sync_every
        if period % count:
            raise ValueError(f"sync_every={period} is not a multiple of the {count} fragments; every fragment "
                             f"syncs once per sync_every steps, so use e.g. sync_every={count * max(1, period // count)}")
        self.stride = period // count
        if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)) or not 0 <= delay < self.stride:
            raise ValueError(f"fragment_sync_delay (τ) = {delay!r} must be an int with 0 <= τ < sync_every / "
                             f"fragments = {self.stride} (a fragment's sync must land before the next one begins)")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)) or \
                not 0.0 <= alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha (α) = {alpha!r} must be a number in [0, 1] (0 restarts from "
                             "the synced weights, 1 keeps the local ones; the paper uses 0.5)")
        self.delay, self.alpha = int(delay), float(alpha)
        if check:
            check_identical(self.params, comm)
        where = dict(self.params)
        self.parts = [LocalSync([(n, where[n]) for n in names], self.config, comm=comm, check=False,
                                overlap=self.delay > 0) for names in self.fragments]
        self.reference = {n: x for part in self.parts for n, x in part.reference.items()}
        self.steps = 0
        self.dropped = 0
        """Fragment syncs that were due to land but had been abandoned (see :meth:`abandon`)."""

    # --------------------------------------------------------------- schedule
    def _slot(self, step: int) -> int:
        return check_step(step) % self.config.sync_every

    def lands(self, step: int) -> int | None:
        """Return the fragment whose sync lands after step ``step`` (None if none does)."""
        slot = self._slot(step)
        return (slot // self.stride - 1) % len(self.parts) if slot % self.stride == 0 else None

    def begins(self, step: int) -> int | None:
        """Return the fragment whose sync begins after step ``step`` (None if none does)."""
        return self.lands(step + self.delay)

    def due(self, step: int) -> bool:
        """Return whether step ``step`` (counting from 1) begins or finishes a fragment's sync."""
        return self.lands(step) is not None or self.begins(step) is not None

    def sync(self, states: Mapping[str, Any] | None = None,
             outer: Callable[[LocalSync, Mapping[str, Any]], None] | None = None) -> dict[str, Any]:
        """Begin and finish the fragments' syncs due after this step; return the landed average.

        Args:
            states: not supported (optimizer states are not averaged fragment by fragment); pass None.
            outer: ``outer(part, delta)`` applies the caller's outer step to ``part.reference``
                instead of the configured SGD; the weights then restart from it (mixed by ``alpha``).

        Returns:
            ``{name: averaged pseudo-gradient}`` of the fragment that landed (empty if none did),
            views valid until that fragment's next sync.
        """
        if states:
            raise ValueError("StreamingSync does not average optimizer states; sync them with a LocalSync")
        begin, land = self.begins(self.steps), self.lands(self.steps)
        if begin is not None:
            self.parts[begin].begin()
        if land is None:
            return {}
        part = self.parts[land]
        if not part.in_flight:  # dropped by abandon() (a re-formed world): θ_ref is unchanged, the next sync
            self.dropped += 1   # carries this one's progress
            return {}
        delta = part.finish()
        if outer is None:
            part.outer_step(delta, self.alpha)
        else:
            outer(part, delta)
            part.restart(self.alpha)
        return dict(delta)

    def abandon(self) -> None:
        """Forget the syncs in flight (their communicator failed); their progress travels with the next ones."""
        for part in self.parts:
            part.abandon()

    @property
    def syncs(self) -> int:
        """Return the fragment syncs finished so far."""
        return sum(part.syncs for part in self.parts)

    # -------------------------------------------------------------- accounting
    @property
    def values_per_sync(self) -> int:
        """Return the most numbers one fragment's sync all-reduces."""
        return max(part.values_per_sync for part in self.parts)

    @property
    def bytes_per_sync(self) -> int:
        """Return the most bytes one fragment's sync hands to MPI on this rank (the peak), by formula."""
        return max(part.bytes_per_sync for part in self.parts)

    @property
    def bytes_per_period(self) -> int:
        """Return the bytes of every fragment's sync: one period of ``sync_every`` steps."""
        return sum(part.bytes_per_sync for part in self.parts)

    @property
    def messages_per_sync(self) -> int:
        """Return the most collectives one fragment's sync issues."""
        return max(part.messages_per_sync for part in self.parts)

    def state_bytes(self) -> int:
        """Return the bytes of the reference weights and outer momentum."""
        return sum(part.state_bytes() for part in self.parts)

    def buffer_bytes(self) -> int:
        """Return the bytes of the fused send/receive buffers."""
        return sum(part.buffer_bytes() for part in self.parts)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the step count and every fragment's state (a sync in flight is waited for and saved).

        The fragments share their codec (one per spec): its state is saved with the first only.
        """
        parts, seen = [], set()
        for part in self.parts:
            sub = part.state_dict()
            if part.codec is not None and id(part.codec) in seen:
                sub["codec"] = {**sub["codec"], "codec": None}
            seen.add(id(part.codec))
            parts.append(sub)
        return {"steps": self.steps, "delay": self.delay, "fragments": [list(names) for names in self.fragments],
                "parts": parts}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (same fragments and delay)."""
        saved = [list(names) for names in state.get("fragments", [])]
        if saved != [list(names) for names in self.fragments]:
            raise ValueError(f"checkpoint fragments differ from this schedule's ({len(saved)} saved, "
                             f"{len(self.fragments)} here); build it with the same fragments to resume")
        if int(state.get("delay", self.delay)) != self.delay:
            raise ValueError(f"checkpoint was saved with fragment_sync_delay={state['delay']}, this schedule has "
                             f"{self.delay} (a saved sync in flight lands by the saved one); build it with "
                             f"fragment_sync_delay={state['delay']} to resume")
        for part, sub in zip(self.parts, state["parts"]):
            part.load_state_dict(sub)
        self.steps = int(state["steps"])
