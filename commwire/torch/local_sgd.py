"""Infrequent synchronisation for PyTorch: ``DiLoCo``, ``LoRDO`` and the low-rank DDP baseline ``LowRankAdam``.

``DiLoCo`` and ``LoRDO`` are ``torch.optim.Optimizer`` subclasses that train
locally and communicate only on every ``sync_every``-th ``step()``: the
pseudo-gradients θ_ref − θ travel in one fused all-reduce per dtype (any
codec), optionally followed by one fused all-reduce of optimizer states. The
schedule is :class:`commwire.schedules.LocalSync`; the LoRDO math is
:mod:`commwire.schedules.lordo`. ``LowRankAdam`` is GaLore-style low-rank
Adam for every-step gradient averaging (wrap it in ``DistributedOptimizer``).

Example:
    >>> import commwire.torch as hvd
    >>> hvd.init()
    >>> opt = hvd.LoRDO(model.named_parameters(), lr=2e-3, rank=32, sync_every=32, omega=0.97)
    >>> for x, y in batches:
    ...     opt.zero_grad(); model.loss(x, y).backward(); opt.step()   # all-reduces every 32nd step
    >>> opt.bytes_per_sync, opt.diagnostics[-1]["similarity"]
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.runtime import world
from ..fusion import FusionBuffer
from ..schedules.local import LocalSync, LocalSyncConfig
from ..schedules.lordo import (
    LoRDOConfig,
    adam_step,
    init_adam_state,
    init_lowrank_state,
    is_projected,
    lowrank_bootstrap,
    lowrank_step,
    refresh_basis,
)

__all__ = ["DiLoCo", "LoRDO", "LowRankAdam", "state_nbytes"]


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Return the bytes of optimizer state: tensors in ``optimizer.state`` plus any sync state it keeps."""
    total = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    extra = getattr(optimizer, "schedule_state_bytes", None)
    return total + (extra() if callable(extra) else 0)


def _split_named(items: list[Any], start: int) -> tuple[list[str], list[torch.Tensor]]:
    if items and all(isinstance(i, tuple) and len(i) == 2 for i in items):
        return [n for n, _ in items], [p for _, p in items]
    if any(isinstance(i, tuple) for i in items):
        raise ValueError("params mixes (name, parameter) pairs and bare tensors; pass one kind")
    return [f"param.{start + i}" for i in range(len(items))], items


def _named_groups(params: Any) -> tuple[list[tuple[str, torch.Tensor]], list[dict[str, Any]]]:
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors, (name, tensor) pairs or param-group dicts, "
                        "got a single tensor; wrap it in a list")
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    raw_groups = items if all(isinstance(i, Mapping) for i in items) else [{"params": items}]
    named: list[tuple[str, torch.Tensor]] = []
    groups: list[dict[str, Any]] = []
    for g in raw_groups:
        members = g["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        names, tensors = _split_named(members, len(named))
        named += list(zip(names, tensors))
        groups.append({**g, "params": tensors})
    names = [n for n, _ in named]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"parameter names must be unique; duplicated: {dupes[:5]}")
    for name, p in named:
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            raise TypeError(f"parameter {name!r} must be a floating-point tensor, got {type(p).__name__}")
    return named, groups


class _LocalOptimizer(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """Shared machinery: named parameters, local steps, the LocalSync schedule, checkpoints."""

    def __init__(self, params: Any, defaults: dict[str, Any], schedule: LocalSyncConfig,
                 comm: Communicator | None, check: bool) -> None:
        named, groups = _named_groups(params)
        super().__init__(groups, defaults)
        self.comm = comm if comm is not None else world()
        self._named = named
        self._names = {p: n for n, p in named}
        self.diagnostics: list[dict[str, Any]] = []
        with torch.no_grad():
            self._init_state()
            self._sync = LocalSync(named, schedule, comm=self.comm, states=self._state_tensors(), check=check)

    @abc.abstractmethod
    def _init_state(self) -> None:
        """Allocate every parameter's optimizer state (before the schedule, which names the synced states)."""

    @abc.abstractmethod
    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Return the ``(name, tensor)`` states averaged at each sync (may be empty)."""

    @abc.abstractmethod
    def _local_update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], step: int) -> None:
        """Apply one local update to ``p`` in place."""

    def _before_first_step(self) -> None:
        """Prepare what the first local update needs (nothing by default)."""

    def _after_sync(self, delta: Mapping[str, torch.Tensor]) -> None:
        """React to the averaged pseudo-gradients of a sync (nothing by default)."""

    # ------------------------------------------------------------------ step
    @property
    def sync_every(self) -> int:
        """Return K, the local steps between synchronisations."""
        return self._sync.config.sync_every

    @property
    def local_steps(self) -> int:
        """Return how many steps this optimizer has taken."""
        return self._sync.steps

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Take one local step; on every ``sync_every``-th call, synchronise with the other ranks."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._sync.steps == 0:
            self._before_first_step()
        t = self._sync.steps + 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"parameter {self._names[p]!r} has a sparse gradient; "
                                       f"{type(self).__name__} needs dense gradients")
                self._local_update(p, p.grad, group, t)
        if self._sync.tick():
            self._after_sync(self._sync.sync(dict(self._state_tensors())))
        return loss

    # ------------------------------------------------------------ accounting
    @property
    def values_per_sync(self) -> int:
        """Return the numbers one sync all-reduces (pseudo-gradients plus averaged states)."""
        return self._sync.values_per_sync

    @property
    def bytes_per_sync(self) -> int:
        """Return the bytes one sync hands to MPI on this rank (what ``commwire.stats()`` counts)."""
        return self._sync.bytes_per_sync

    @property
    def bytes_per_step(self) -> float:
        """Return bytes per step in the steady state: ``bytes_per_sync / sync_every``."""
        return self._sync.bytes_per_sync / self.sync_every

    def schedule_state_bytes(self) -> int:
        """Return the bytes of the reference weights and outer momentum."""
        return self._sync.state_bytes()

    def state_bytes(self) -> int:
        """Return all optimizer-state bytes: per-parameter state plus the schedule's."""
        return state_nbytes(self)

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Return torch's optimizer state dict plus the schedule state under "commwire"."""
        sd = super().state_dict()
        sd["commwire"] = {"schedule": self._sync.state_dict(), "diagnostics": list(self.diagnostics),
                          "names": [n for n, _ in self._named]}
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Restore a state dict from :meth:`state_dict`; training then continues exactly."""
        sd = dict(state_dict)
        ours = sd.pop("commwire", None)
        if ours is None:
            raise ValueError(f"state_dict has no 'commwire' entry; it was not saved by {type(self).__name__}."
                             "state_dict()")
        names = [n for n, _ in self._named]
        if ours["names"] != names:
            raise ValueError(f"checkpoint parameter names differ from this optimizer's (first saved "
                             f"{ours['names'][:2]}, now {names[:2]}); build the optimizer over the same model")
        super().load_state_dict(sd)
        with torch.no_grad():
            self._sync.load_state_dict(ours["schedule"])
        self.diagnostics = list(ours["diagnostics"])


class DiLoCo(_LocalOptimizer):
    """Local AdamW for ``sync_every`` steps, then average pseudo-gradients and take a Nesterov outer step.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or param groups.
        lr, betas, eps, weight_decay: the inner AdamW (per param group).
        sync_every: K, local steps per synchronisation (>= 1).
        outer_lr, outer_momentum, nesterov: the outer SGD step on the pseudo-gradient
            (DiLoCo: 0.7, 0.9, Nesterov; 1.0, 0.0 is plain parameter averaging = local Adam).
        average_moments: also average the inner Adam moments at a sync (2P more values).
        codec: wire format of the pseudo-gradients (e.g. "fp8-e4m3").
        comm: communicator (default: the world).
        check: verify that the parameters are identical on every rank (one allgather of hashes).

    Example:
        >>> opt = DiLoCo(model.named_parameters(), lr=2e-3, sync_every=32)
    """

    def __init__(self, params: Any, lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, sync_every: int = 32, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, average_moments: bool = False,
                 codec: Any = None, comm: Communicator | None = None, check: bool = True) -> None:
        _check_adam(lr, betas, eps, weight_decay)
        self.average_moments = average_moments
        schedule = LocalSyncConfig(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum,
                                   nesterov=nesterov, codec=codec)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, schedule, comm, check)

    def _init_state(self) -> None:
        for _, p in self._named:
            self.state[p].update(init_adam_state(p.detach()))

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        if not self.average_moments:
            return []
        return [(f"{n}.{k}", self.state[p][k]) for n, p in self._named for k in ("exp_avg", "exp_avg_sq")]

    def _local_update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], step: int) -> None:
        adam_step(p, grad, self.state[p], lr=group["lr"], step=step, betas=group["betas"], eps=group["eps"],
                  weight_decay=group["weight_decay"])


class LoRDO(_LocalOptimizer):
    """LoRDO: low-rank local Adam in a global subspace, full-rank QH term, sync every ``sync_every`` steps.

    Each matrix parameter with ``rank < min(m, n)`` keeps Adam moments in a rank-r
    subspace whose basis is the top-r singular vectors of the averaged
    pseudo-gradient (computed identically on every rank, never sent); a
    matrix with ``rank >= min(m, n)`` falls back to full-rank AdamW, as do
    non-matrix parameters (``projected_names`` lists the projected ones). The
    first basis comes from the gradient of the first step, averaged once.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or param groups.
        lr, betas, eps, weight_decay: per param group.
        rank: r, the subspace dimension.
        sync_every: K (>= 1).
        omega: ω in [0, 1]; 1 − ω weights the full-rank QH term (1 = no QH term: stagnates).
        clip: clip each gradient to this Frobenius norm first (None: off).
        error_feedback: keep the projection's residual and add it to the next gradient.
        rotate: rotate the moments into each new basis.
        sync_states: states averaged at each sync, from ("moments", "error_feedback").
        outer_lr, outer_momentum, nesterov: outer step (default plain averaging).
        codec: wire format of the pseudo-gradients; state_codec: of the averaged states.
        comm: communicator (default: the world).
        check: verify that the parameters are identical on every rank.

    Example:
        >>> opt = LoRDO(model.named_parameters(), lr=2e-3, rank=32, sync_every=32, omega=0.97, codec="fp8-e4m3")
    """

    def __init__(self, params: Any, lr: float = 1e-3, *, rank: int, sync_every: int = 32, omega: float = 0.97,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 1e-5,
                 clip: float | None = None, error_feedback: bool = True, rotate: bool = True,
                 sync_states: tuple[str, ...] = ("moments",), outer_lr: float = 1.0, outer_momentum: float = 0.0,
                 nesterov: bool = True, codec: Any = None, state_codec: Any = None,
                 comm: Communicator | None = None, check: bool = True) -> None:
        _check_adam(lr, betas, eps, weight_decay)
        self.config = LoRDOConfig(rank=rank, omega=omega, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                  clip=clip, error_feedback=error_feedback, rotate=rotate,
                                  sync_states=tuple(sync_states))
        schedule = LocalSyncConfig(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum,
                                   nesterov=nesterov, codec=codec, state_codec=state_codec)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, schedule, comm, check)

    @property
    def projected_names(self) -> list[str]:
        """Return the names of the parameters with low-rank moments."""
        return [n for n, p in self._named if "basis" in self.state[p]]

    def _init_state(self) -> None:
        for _, p in self._named:
            if is_projected(tuple(p.shape), self.config.rank):
                self.state[p].update(init_lowrank_state(p.detach(), self.config.rank,
                                                        error_feedback=self.config.error_feedback))
            else:
                self.state[p].update(init_adam_state(p.detach()))

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        keys = (("exp_avg", "exp_avg_sq") if "moments" in self.config.sync_states else ()) + \
               (("error",) if "error_feedback" in self.config.sync_states else ())
        return [(f"{n}.{k}", self.state[p][k]) for n, p in self._named for k in keys if k in self.state[p]]

    def _group_config(self, group: dict[str, Any]) -> LoRDOConfig:
        c = self.config
        if (tuple(group["betas"]), group["eps"], group["weight_decay"]) == (c.betas, c.eps, c.weight_decay):
            return c
        return LoRDOConfig(rank=c.rank, omega=c.omega, betas=tuple(group["betas"]), eps=group["eps"],
                           weight_decay=group["weight_decay"], clip=c.clip, error_feedback=c.error_feedback,
                           rotate=c.rotate, sync_states=c.sync_states)

    def _local_update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], step: int) -> None:
        state = self.state[p]
        if "basis" in state:
            lowrank_step(p, grad, state, lr=group["lr"], step=step, config=self._group_config(group))
        else:
            adam_step(p, grad, state, lr=group["lr"], step=step, betas=group["betas"], eps=group["eps"],
                      weight_decay=group["weight_decay"])

    def _before_first_step(self) -> None:
        # Every rank needs the same first basis: average the first gradient of the projected
        # matrices once (one fused message, counted by the stats like any all-reduce).
        projected = [(n, p) for n, p in self._named if "basis" in self.state[p]]
        if not projected:
            return
        fb = FusionBuffer(projected, comm=self.comm, op="avg", threshold_bytes=1 << 62, first_bucket_bytes=0,
                          overlap=False)
        for name, p in projected:
            fb.add(name, p.grad if p.grad is not None else torch.zeros_like(p))
        averaged = fb.wait()
        for name, p in projected:
            lowrank_bootstrap(self.state[p], averaged[name], self.config.rank)

    @property
    def bootstrap_bytes(self) -> int:
        """Return the bytes of the one-time first-gradient all-reduce that seeds the bases."""
        return sum(p.numel() * p.element_size() for n, p in self._named if "basis" in self.state[p])

    def _after_sync(self, delta: Mapping[str, torch.Tensor]) -> None:
        similarity, ranks = {}, {}
        for name, p in self._named:
            state = self.state[p]
            if "basis" in state:
                report = refresh_basis(state, delta[name], self.config.rank, rotate=self.config.rotate)
                similarity[name], ranks[name] = report.similarity, report.numerical_rank
        self.diagnostics.append({"step": self._sync.steps, "similarity": similarity, "rank": ranks})


class LowRankAdam(torch.optim.Optimizer):
    """GaLore-style low-rank AdamW: moments in a rank-r subspace refreshed every ``refresh_every`` steps.

    The basis comes from the gradient in ``.grad`` at steps 1, 1 + K, 1 + 2K, ...
    Wrapped in ``DistributedOptimizer`` that gradient is the average over ranks,
    so every rank computes the same basis: this is low-rank DDP. Matrices with
    ``rank >= min(m, n)`` and non-matrix parameters use full-rank AdamW.

    Example:
        >>> opt = hvd.DistributedOptimizer(LowRankAdam(model.parameters(), lr=2e-3, rank=32),
        ...                                named_parameters=model.named_parameters())
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, *, rank: int, refresh_every: int = 32,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 rotate: bool = True) -> None:
        _check_adam(lr, betas, eps, weight_decay)
        if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or refresh_every < 1:
            raise ValueError(f"refresh_every={refresh_every!r} must be an integer >= 1")
        self.config = LoRDOConfig(rank=rank, omega=1.0, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                  error_feedback=False, rotate=rotate, sync_states=())
        self.refresh_every = refresh_every
        self.diagnostics: list[dict[str, Any]] = []
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Take one low-rank AdamW step (refreshing each basis from the current gradient when due)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        similarity = {}
        for gi, group in enumerate(self.param_groups):
            cfg = LoRDOConfig(rank=self.config.rank, omega=1.0, betas=tuple(group["betas"]), eps=group["eps"],
                              weight_decay=group["weight_decay"], error_feedback=False, rotate=self.config.rotate,
                              sync_states=())
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    projected = is_projected(tuple(p.shape), cfg.rank)
                    state.update(init_lowrank_state(p, cfg.rank, error_feedback=False) if projected
                                 else init_adam_state(p))
                    state["step"] = 0
                state["step"] += 1
                t = state["step"]
                if "basis" in state:
                    if t == 1:
                        lowrank_bootstrap(state, p.grad, cfg.rank)
                    elif (t - 1) % self.refresh_every == 0:
                        similarity[f"{gi}.{pi}"] = refresh_basis(state, p.grad, cfg.rank, rotate=cfg.rotate).similarity
                    lowrank_step(p, p.grad, state, lr=group["lr"], step=t, config=cfg)
                else:
                    adam_step(p, p.grad, state, lr=group["lr"], step=t, betas=group["betas"], eps=group["eps"],
                              weight_decay=group["weight_decay"])
        if similarity:
            self.diagnostics.append({"similarity": similarity})
        return loss


def _check_adam(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not lr > 0:
        raise ValueError(f"lr={lr} must be > 0")
    if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas={betas} must be two values in [0, 1), e.g. (0.9, 0.95)")
    if not eps > 0:
        raise ValueError(f"eps={eps} must be > 0")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay={weight_decay} must be >= 0")
