"""LoRDOSchedule: run LoRDO on named arrays: local low-rank steps, a LocalSync every K steps, basis refreshes.

The update rule (low-rank Adam in a global subspace, error feedback, the
full-rank QH term, the warm-up and beta switch) is :mod:`commwire.optim.lordo`;
this module decides when the ranks communicate and what they send: a DDP
warm-up averages the gradients every step (:class:`~commwire.schedules.EveryStep`),
the first gradients are averaged once to seed identical bases, and every K-th
step averages the pseudo-gradients (and the states named by ``sync_states``)
and refreshes each basis from them (:class:`~commwire.schedules.LocalSync`).
``commwire.torch.LoRDO`` is this engine behind torch's optimizer interface.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from ..comm.arrays import copy, nbytes
from ..optim.lordo import (
    LoRDOConfig,
    adam_step,
    clip_factor,
    init_adam_state,
    init_lowrank_state,
    is_projected,
    lowrank_bootstrap,
    lowrank_step,
    refresh_basis,
    state_category,
)
from .base import check_step, fused_average
from .every import EveryStep
from .local import LocalSync, LocalSyncConfig

__all__ = ["LoRDO", "LoRDOSchedule"]


class LoRDOSchedule:
    """Run LoRDO on named arrays (numpy or torch): local low-rank steps, a LocalSync every K steps.

    ``commwire.torch.LoRDO`` is this engine behind torch's optimizer interface
    (same math, same schedule): call :meth:`step` with this rank's gradients
    once per step. As a :class:`~commwire.schedules.Schedule`, :meth:`step` does
    the counting (there is no separate ``tick``); ``syncs`` counts the
    pseudo-gradient syncs, ``bytes_per_sync`` is the size of one.

    Args:
        params: ``(name, array)`` pairs, the live weights, identical on every rank.
        config: the LoRDO hyperparameters.
        schedule: the sync schedule (default: every 32 steps, plain averaging).
        comm: communicator (default: the world).
        check: verify that ``params`` are identical on every rank.
        states: per-parameter state dicts to fill and use (default: new ones), e.g.
            a torch optimizer's ``state[p]``; assign :attr:`state` again if they are replaced.

    Example:
        >>> opt = LoRDOSchedule([("w", w)], LoRDOConfig(rank=4), LocalSyncConfig(sync_every=16))
        >>> synced = opt.step({"w": grad_w}, lr=1e-3)
        >>> opt.stats()["memory"]["total"]
    """

    def __init__(self, params: Any, config: LoRDOConfig, schedule: Any = None, *, comm: Any = None,
                 check: bool = True, states: Mapping[str, MutableMapping[str, Any]] | None = None) -> None:
        self.params = list(params)
        self.config = config
        self.state: dict[str, MutableMapping[str, Any]] = {}
        for name, x in self.params:
            target = states[name] if states is not None else {}
            target.update(init_lowrank_state(x, config.rank, error_feedback=config.error_feedback)
                          if is_projected(tuple(x.shape), config.rank) else init_adam_state(x))
            self.state[name] = target
        schedule = schedule if schedule is not None else LocalSyncConfig()
        if config.warmup_steps % schedule.sync_every:
            raise ValueError(f"warmup_steps={config.warmup_steps} must be a multiple of sync_every="
                             f"{schedule.sync_every} (the warm-up ends where a local period starts)")
        self.schedule = LocalSync(self.params, schedule, comm=comm, states=self.synced_states(), check=check)
        self.diagnostics: list[dict[str, Any]] = []
        self.bytes_sent = 0
        self._warmup: EveryStep | None = None  # built at the first warm-up step: its buffers cost memory

    @property
    def comm(self) -> Any:
        """Return the communicator."""
        return self.schedule.comm

    @property
    def projected_names(self) -> list[str]:
        """Return the names of the parameters with low-rank moments."""
        return [n for n, _ in self.params if "basis" in self.state[n]]

    def synced_states(self) -> list[tuple[str, Any]]:
        """Return the ``(name, array)`` states that ``config.sync_states`` averages at a sync."""
        keys = (("exp_avg", "exp_avg_sq") if "moments" in self.config.sync_states else ()) + \
               (("error",) if "error_feedback" in self.config.sync_states else ())
        return [(f"{n}.{k}", self.state[n][k]) for n, _ in self.params for k in keys if k in self.state[n]]

    # ------------------------------------------------------------------- step
    def step(self, grads: Mapping[str, Any], lr: float | Mapping[str, float],
             weight_decay: Mapping[str, float] | None = None) -> bool:
        """Apply one step with ``{name: gradient}``; sync when due and return whether it communicated.

        ``lr`` (and ``weight_decay``, default the config's) may be per parameter name.
        """
        t = self.schedule.steps + 1
        c = self.config
        phase = c.phase(t)
        if phase.warmup:
            grads = self._average(grads)  # DDP: every rank now holds the same gradients
        if t == 1:
            self._bootstrap(grads, averaged=phase.warmup)
        if phase.starts and c.switch_reset_moments:
            for state in self.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key][...] = 0
        scale = clip_factor((grads.get(n) for n, _ in self.params), c.clip)
        for name, x in self.params:
            g = grads.get(name)
            if g is None:
                continue
            g = g * scale if c.clip is not None else g
            rate = (lr[name] if isinstance(lr, Mapping) else lr) * phase.lr_scale
            wd = weight_decay[name] if weight_decay is not None else c.weight_decay
            if "basis" in self.state[name]:
                lowrank_step(x, g, self.state[name], lr=rate, config=c, phase=phase, weight_decay=wd)
            else:
                adam_step(x, g, self.state[name], lr=rate, step=t, betas=phase.betas, eps=c.eps,
                          weight_decay=wd, bias=phase.bias)
        if not self.schedule.tick():
            return False
        if phase.warmup:
            delta, sent = self.schedule.rebase(), False  # Δ is the same on every rank: nothing to send
        else:
            delta, sent = self.schedule.sync(dict(self.synced_states())), True
            self.bytes_sent += self.schedule.bytes_per_sync
        similarity, ranks = {}, {}
        for name, _ in self.params:
            if "basis" in self.state[name]:
                report = refresh_basis(self.state[name], delta[name], c.rank, rotate=c.rotate)
                similarity[name], ranks[name] = report.similarity, report.numerical_rank
        self.diagnostics.append({"step": self.schedule.steps, "similarity": similarity, "rank": ranks})
        return sent

    def _average(self, grads: Mapping[str, Any]) -> dict[str, Any]:
        if self._warmup is None:
            self._warmup = EveryStep(self.params, comm=self.comm)
        # Missing gradients travel as zeros: every rank gets every averaged gradient.
        averaged = self._warmup.sync({n: grads[n] for n, _ in self.params if grads.get(n) is not None})
        self.bytes_sent += self.warmup_bytes_per_step
        return averaged

    def _bootstrap(self, grads: Mapping[str, Any], *, averaged: bool) -> None:
        # The first basis must be the same everywhere: average the first gradients once
        # (in a warm-up they already are: no message).
        projected = [(n, x) for n, x in self.params if "basis" in self.state[n]]
        if not projected:
            return
        if not averaged:
            fb = fused_average(projected, self.comm, None)
            for name, _ in projected:
                g = grads.get(name)
                fb.view(name)[...] = g if g is not None else 0
                fb.mark(name)
            grads = fb.wait()
            self.bytes_sent += self.bootstrap_bytes
        for name, _ in projected:
            lowrank_bootstrap(self.state[name], grads[name], self.config.rank)

    # --------------------------------------------------------------- schedule
    @property
    def steps(self) -> int:
        """Return the steps taken so far."""
        return self.schedule.steps

    @property
    def syncs(self) -> int:
        """Return the pseudo-gradient syncs made so far."""
        return self.schedule.syncs

    def abandon(self) -> None:
        """Forget a sync in flight whose communicator failed (none is: LoRDO's syncs complete in ``step``)."""
        self.schedule.abandon()

    def due(self, step: int) -> bool:
        """Return whether step ``step`` (counting from 1) communicates.

        Every warm-up step does (its gradients), every K-th step after it does (the
        sync), and so does step 1 when the first gradients seed the bases.
        """
        t = check_step(step)
        return t <= self.config.warmup_steps or t % self.schedule.config.sync_every == 0 or \
            (t == 1 and self.bootstrap_bytes > 0)

    @property
    def bytes_per_sync(self) -> int:
        """Return the bytes one sync hands to MPI on this rank (pseudo-gradients plus averaged states)."""
        return self.schedule.bytes_per_sync

    @property
    def bytes_per_period(self) -> int:
        """Return the bytes of one period of ``sync_every`` steps after the warm-up: one sync."""
        return self.schedule.bytes_per_period

    @property
    def messages_per_sync(self) -> int:
        """Return the number of collectives one sync issues."""
        return self.schedule.messages_per_sync

    # ------------------------------------------------------------- accounting
    @property
    def bootstrap_bytes(self) -> int:
        """Return the bytes of the one-time first-gradient all-reduce that seeds the bases (0 with a warm-up)."""
        if self.config.warmup_steps:
            return 0
        return sum(nbytes(x) for n, x in self.params if "basis" in self.state[n])

    @property
    def warmup_bytes_per_step(self) -> int:
        """Return the bytes one warm-up step all-reduces (every gradient, uncompressed)."""
        return sum(nbytes(x) for _, x in self.params)

    def memory(self) -> dict[str, int]:
        """Return optimizer-state bytes by kind: low-rank and Adam moments, bases, EF, reference, outer momentum."""
        out = dict.fromkeys(("lowrank_moments", "basis", "error_feedback", "adam_moments"), 0)
        for name, _ in self.params:
            state = self.state[name]
            projected = "basis" in state
            for key, value in state.items():
                if hasattr(value, "shape") and getattr(value, "ndim", 0) > 0:
                    out[state_category(key, projected)] += nbytes(value)
        out["reference"] = sum(nbytes(a) for a in self.schedule.reference.values())
        out["outer_momentum"] = sum(nbytes(a) for a in self.schedule.momentum.values())
        out["total"] = sum(out.values())
        return out

    def stats(self) -> dict[str, Any]:
        """Return what this optimizer sends ("bytes") and holds ("memory"), in bytes.

        ``bytes["sent"]`` counts every all-reduce it issued so far (bootstrap,
        warm-up gradients, syncs): what ``commwire.stats()`` adds up for them.
        """
        k = self.schedule.config.sync_every
        per_sync = self.schedule.bytes_per_sync
        return {
            "bytes": {"sent": self.bytes_sent, "per_sync": per_sync, "per_step": per_sync / k,
                      "values_per_sync": self.schedule.values_per_sync, "bootstrap": self.bootstrap_bytes,
                      "warmup_per_step": self.warmup_bytes_per_step if self.config.warmup_steps else 0,
                      "syncs": self.schedule.syncs, "steps": self.schedule.steps},
            "memory": self.memory(),
        }

    # ------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        """Return the non-tensor state: schedule, diagnostics, byte count."""
        return {"schedule": self.schedule.state_dict(), "diagnostics": list(self.diagnostics),
                "bytes_sent": self.bytes_sent}

    def load_extra_state(self, extra: Mapping[str, Any]) -> None:
        """Restore what :meth:`extra_state` returned."""
        self.schedule.load_state_dict(extra["schedule"])
        self.diagnostics = list(extra["diagnostics"])
        self.bytes_sent = int(extra.get("bytes_sent", 0))

    def state_dict(self) -> dict[str, Any]:
        """Return copies of every per-parameter state plus :meth:`extra_state`."""
        return {"state": {n: {k: copy(v) for k, v in s.items()} for n, s in self.state.items()},
                **self.extra_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (same parameter names, shapes and config)."""
        saved = state["state"]
        if set(saved) != set(self.state):
            raise ValueError(f"checkpoint parameters differ from this optimizer's (saved {sorted(saved)[:3]}, "
                             f"now {sorted(self.state)[:3]}); build it over the same parameters")
        for name, values in saved.items():
            mine = self.state[name]
            if set(values) != set(mine):
                raise ValueError(f"checkpoint state of {name!r} has {sorted(values)}, this optimizer "
                                 f"{sorted(mine)}: build it with the same rank and error_feedback")
            for key, value in values.items():
                mine[key][...] = value
        self.load_extra_state(state)


LoRDO = LoRDOSchedule
"""The name the layer map gives it (``commwire.schedules.LoRDO``); ``commwire.torch.LoRDO`` is the torch optimizer."""
