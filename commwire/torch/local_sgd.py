"""Infrequent synchronisation for PyTorch: ``DiLoCo``, ``LoRDO`` and the low-rank DDP baseline ``LowRankAdam``.

``DiLoCo`` and ``LoRDO`` are ``torch.optim.Optimizer`` subclasses that train
locally and communicate only on every ``sync_every``-th ``step()``: the
pseudo-gradients θ_ref − θ travel in one fused all-reduce per dtype (any
codec), optionally followed by one fused all-reduce of optimizer states. The
schedule is :class:`commwire.schedules.LocalSync` (LoRDO's:
:class:`commwire.schedules.LoRDOSchedule`); the LoRDO math is
:mod:`commwire.optim.lordo`. ``DiLoCo`` runs any torch optimizer as its inner
and outer step (``inner_optimizer=``, ``outer_optimizer=``). ``LowRankAdam`` is
GaLore-style low-rank Adam for every-step gradient averaging (wrap it in
``DistributedOptimizer``).

Example:
    >>> import commwire.torch as hvd
    >>> hvd.init()
    >>> opt = hvd.LoRDO(model.named_parameters(), lr=2e-3, rank=32, sync_every=32, omega=0.97)
    >>> for x, y in batches:
    ...     opt.zero_grad(); model.loss(x, y).backward(); opt.step()   # all-reduces every 32nd step
    >>> opt.bytes_per_sync, opt.diagnostics[-1]["similarity"]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._validate import positive_int
from ..comm.communicator import Communicator
from ..comm.runtime import default_comm
from ..fusion import check_unique_names
from ..optim.lordo import (
    LoRDOConfig,
    adam_step,
    init_adam_state,
    init_lowrank_state,
    is_projected,
    lowrank_bootstrap,
    lowrank_step,
    refresh_basis,
)
from ..schedules import LocalSync, LocalSyncConfig, LoRDOSchedule, StreamingSync

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
    check_unique_names([n for n, _ in named], "parameter names")
    for name, p in named:
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            raise TypeError(f"parameter {name!r} must be a floating-point tensor, got {type(p).__name__}")
    return named, groups


class _LocalOptimizer(torch.optim.Optimizer):
    """Shared machinery: named parameters, local steps, the LocalSync schedule, checkpoints."""

    def __init__(self, params: Any, defaults: dict[str, Any], schedule: LocalSyncConfig,
                 comm: Communicator | None, check: bool) -> None:
        named, groups = _named_groups(params)
        # torch fills each group dict with the defaults: keep what the caller gave for an inner-optimizer factory.
        self._given_groups = [{**g, "params": list(g["params"])} for g in groups]
        super().__init__(groups, defaults)
        self.comm = default_comm(comm)
        self._given_comm, self._schedule_config, self._check = comm, schedule, check
        self._named = named
        self._names = {p: n for n, p in named}
        self.diagnostics: list[dict[str, Any]] = []
        with torch.no_grad():
            self._init_state()
            self._sync = self._schedule(named, schedule, check)

    def _schedule(self, named: list[tuple[str, torch.Tensor]], schedule: LocalSyncConfig,
                  check: bool) -> LocalSync:
        """Build the schedule over the allocated optimizer state (it names the synced states)."""
        return LocalSync(named, schedule, comm=self.comm, states=self._state_tensors(), check=check)

    def _rebind(self) -> None:
        """Bind the schedule to commwire's re-formed world (commwire.elastic), keeping the optimizer state.

        The schedule's own state (its step count, the last synced point) carries over; only
        its communicator changes.
        """
        if self._given_comm is not None:
            return
        self._sync.abandon()  # a sync in flight on the old communicator: its progress travels with the next
        kept = self.state_dict()
        self.comm = default_comm(None)
        with torch.no_grad():
            self._sync = self._schedule(self._named, self._schedule_config, self._check)
        self.load_state_dict(kept)

    def _init_state(self) -> None:
        """Allocate every parameter's optimizer state up front (none by default: the schedule may)."""

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Return the ``(name, tensor)`` states averaged at each sync (may be empty)."""
        raise NotImplementedError

    def _local_update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], step: int) -> None:
        """Apply one local update to ``p`` in place."""
        raise NotImplementedError

    # ------------------------------------------------------------------ step
    @property
    def sync_every(self) -> int:
        """Return K, the local steps between synchronisations."""
        return self._sync.config.sync_every

    @property
    def local_steps(self) -> int:
        """Return how many steps this optimizer has taken."""
        return self._sync.steps

    def _gradients(self) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
        """Return ``(name, grad, group)`` for every parameter with a gradient (dense ones only)."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"parameter {self._names[p]!r} has a sparse gradient; "
                                       f"{type(self).__name__} needs dense gradients")
                out.append((self._names[p], p.grad, group))
        return out

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Take one local step; on every ``sync_every``-th call, synchronise with the other ranks."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._local_step(self._sync.steps + 1)
        if self._sync.tick():
            self._synchronise()
        return loss

    def _local_step(self, step: int) -> None:
        """Apply the local update of step ``step`` to every parameter with a gradient."""
        params = dict(self._named)
        for name, grad, group in self._gradients():
            self._local_update(params[name], grad, group, step)

    def _synchronise(self) -> None:
        """Average the pseudo-gradients (and states), take the outer step, restart from the reference."""
        self._sync.sync(dict(self._state_tensors()))

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
        """Return bytes per step in the steady state: the bytes of one period over ``sync_every``."""
        return self._sync.bytes_per_period / self.sync_every

    def schedule_state_bytes(self) -> int:
        """Return the bytes of the reference weights and outer momentum."""
        return self._sync.state_bytes()

    def state_bytes(self) -> int:
        """Return all optimizer-state bytes: per-parameter state plus the schedule's."""
        return state_nbytes(self)

    # ----------------------------------------------------------- checkpoints
    def _extra_state(self) -> dict[str, Any]:
        return {"schedule": self._sync.state_dict(), "diagnostics": list(self.diagnostics)}

    def _check_extra_state(self, extra: Mapping[str, Any]) -> None:
        """Raise ValueError if ``extra`` cannot be loaded, before anything is changed."""

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:
        self._sync.load_state_dict(extra["schedule"])
        self.diagnostics = list(extra["diagnostics"])

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Return torch's optimizer state dict plus the schedule state under "commwire"."""
        sd = super().state_dict()
        sd["commwire"] = {**self._extra_state(), "names": [n for n, _ in self._named]}
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
        self._check_extra_state(ours)
        super().load_state_dict(sd)
        with torch.no_grad():
            self._load_extra_state(ours)


class DiLoCo(_LocalOptimizer):
    """Local steps of an inner optimizer for ``sync_every`` steps, then average pseudo-gradients and take an outer step.

    By default the inner optimizer is AdamW and the outer step Nesterov SGD on
    the averaged pseudo-gradient θ_ref − θ (DiLoCo's recipe); any torch optimizer
    can take either place, as in torchft's DiLoCo.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or param groups.
        lr, betas, eps, weight_decay: the built-in inner AdamW (per param group).
        sync_every: K, local steps per synchronisation (>= 1).
        outer_lr, outer_momentum, nesterov: the built-in outer SGD step on the pseudo-gradient
            (DiLoCo: 0.7, 0.9, Nesterov; 1.0, 0.0 is plain parameter averaging = local Adam).
        average_moments: also average the inner Adam moments at a sync (2P more values).
        codec: wire format of the pseudo-gradients (e.g. "fp8-e4m3").
        comm: communicator (default: the world).
        check: verify that the parameters are identical on every rank (one allgather of hashes).
        inner_optimizer: the local step instead of the built-in AdamW: a ``torch.optim.Optimizer``
            over exactly the tensors of ``params``, or a factory that DiLoCo calls with them (a list
            of tensors, or of param-group dicts when ``params`` had groups) and that returns one.
            Its learning rate, LR schedulers and state are its own; leave ``lr``, ``betas``, ``eps``,
            ``weight_decay`` and ``average_moments`` at their defaults.
        outer_optimizer: the outer step instead of the built-in SGD: a factory that DiLoCo calls
            with the reference copies θ_ref it keeps (one tensor per parameter, in ``params``
            order) and that returns a ``torch.optim.Optimizer`` over them; or, as torchft does, an
            optimizer over exactly the tensors of ``params`` (at a sync DiLoCo loads θ_ref into
            them, steps, and keeps the result as the new θ_ref). Either way the tensors' ``.grad``
            is the averaged pseudo-gradient during its ``step()`` (None for the tensors of other
            fragments: with P fragments it steps P times per ``sync_every`` steps, once per fragment,
            which an outer LR scheduler should count). Leave ``outer_lr``, ``outer_momentum`` and
            ``nesterov`` at their defaults.
        fragments: Streaming DiLoCo (torchft's ``model_fragments``): P, the number of fragments
            (consecutive parameters of about equal size), or lists of parameter names (e.g. a
            strided split by layer). Each fragment syncs once per ``sync_every`` steps, fragment i
            after steps (i + 1)·sync_every/P + k·sync_every: a sync carries 1/P of the model.
            ``sync_every`` must be a multiple of P.
        fragment_sync_delay: τ, the steps a fragment's sync stays in flight on the background
            lane while training goes on (0 <= τ < sync_every/P); its pseudo-gradient is taken τ
            steps before it lands.
        fragment_update_alpha: α, the share of the local weights kept when a fragment lands:
            θ = (1 − α)·θ_ref + α·θ (0: restart from the synced weights; the paper uses 0.5 with τ > 0).

    Example:
        >>> opt = DiLoCo(model.named_parameters(), lr=2e-3, sync_every=32)
        >>> opt = DiLoCo(model.named_parameters(), sync_every=32,
        ...              inner_optimizer=torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True),
        ...              outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))
        >>> opt = DiLoCo(model.named_parameters(), lr=2e-3, sync_every=32, codec="ef+nvfp4",
        ...              fragments=4, fragment_sync_delay=2, fragment_update_alpha=0.5)   # Streaming DiLoCo
    """

    def __init__(self, params: Any, lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, sync_every: int = 32, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, average_moments: bool = False,
                 codec: Any = None, comm: Communicator | None = None, check: bool = True,
                 inner_optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
                 outer_optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
                 fragments: int | Iterable[Iterable[str]] = 1, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0) -> None:
        _check_adam(lr, betas, eps, weight_decay)
        self._streaming = None
        if not (isinstance(fragments, int) and fragments == 1) or fragment_sync_delay or fragment_update_alpha:
            if average_moments:
                raise ValueError("average_moments=True is not supported with fragments, fragment_sync_delay or "
                                 "fragment_update_alpha (Streaming DiLoCo syncs no optimizer state); drop one")
            given = fragments if isinstance(fragments, (int, str)) or not isinstance(fragments, Iterable) else \
                list(fragments)
            self._streaming = {"fragments": given,
                               "delay": fragment_sync_delay, "alpha": fragment_update_alpha}
        _refuse_overrides("inner_optimizer", inner_optimizer, {
            "lr": (lr, 1e-3), "betas": (tuple(betas), (0.9, 0.95)), "eps": (eps, 1e-8),
            "weight_decay": (weight_decay, 0.0), "average_moments": (average_moments, False)})
        _refuse_overrides("outer_optimizer", outer_optimizer, {
            "outer_lr": (outer_lr, 0.7), "outer_momentum": (outer_momentum, 0.9), "nesterov": (nesterov, True)})
        if inner_optimizer is not None and inner_optimizer is outer_optimizer:
            raise ValueError("inner_optimizer and outer_optimizer are the same object; give each its own optimizer")
        self.average_moments = average_moments
        self._custom_inner = inner_optimizer is not None
        if outer_optimizer is not None:  # the outer step is the caller's: no built-in momentum buffers
            outer_lr, outer_momentum = 1.0, 0.0
        schedule = LocalSyncConfig(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum,
                                   nesterov=nesterov, codec=codec)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, schedule, comm, check)
        if isinstance(self._sync, StreamingSync):  # a rebind builds the schedule again: from lists, not iterators
            self._streaming["fragments"] = [list(names) for names in self._sync.fragments]
        tensors = [p for _, p in self._named]
        self.inner_optimizer: torch.optim.Optimizer | None = None
        if inner_optimizer is not None:
            given = self._given_groups
            plain = len(given) == 1 and set(given[0]) == {"params"}
            self.inner_optimizer = _optimizer_over("inner_optimizer", inner_optimizer,
                                                   given[0]["params"] if plain else given, tensors, "params")
        self.outer_optimizer: torch.optim.Optimizer | None = None
        self._outer_on_model = isinstance(outer_optimizer, torch.optim.Optimizer)
        if outer_optimizer is not None:
            refs = [self._sync.reference[n] for n, _ in self._named]
            if self._outer_on_model:
                self.outer_optimizer = _optimizer_over("outer_optimizer", outer_optimizer, None, tensors, "params")
            else:
                self.outer_optimizer = _optimizer_over("outer_optimizer", outer_optimizer, refs, refs,
                                                       "the reference copies it was called with")

    def _schedule(self, named: list[tuple[str, torch.Tensor]], schedule: LocalSyncConfig,
                  check: bool) -> LocalSync | StreamingSync:
        if self._streaming is None:
            return super()._schedule(named, schedule, check)
        return StreamingSync(named, schedule, comm=self.comm, check=check, **self._streaming)

    def _rebind(self) -> None:
        old = dict(self._sync.reference)
        super()._rebind()
        if self.outer_optimizer is not None and not self._outer_on_model:
            # The factory-built outer optimizer steps the reference copies: point it at the new ones.
            _repoint(self.outer_optimizer, {id(old[n]): t for n, t in self._sync.reference.items()})

    @property
    def fragments(self) -> list[list[str]]:
        """Return the parameter names of each fragment (one fragment without Streaming DiLoCo)."""
        if isinstance(self._sync, StreamingSync):
            return [list(names) for names in self._sync.fragments]
        return [[n for n, _ in self._named]]

    def _init_state(self) -> None:
        if self._custom_inner:
            return  # the inner optimizer keeps its own state
        for _, p in self._named:
            self.state[p].update(init_adam_state(p.detach()))

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        if not self.average_moments:
            return []
        return [(f"{n}.{k}", self.state[p][k]) for n, p in self._named for k in ("exp_avg", "exp_avg_sq")]

    def _local_update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], step: int) -> None:
        adam_step(p, grad, self.state[p], lr=group["lr"], step=step, betas=group["betas"], eps=group["eps"],
                  weight_decay=group["weight_decay"])

    def _local_step(self, step: int) -> None:
        if self.inner_optimizer is None:
            super()._local_step(step)
        else:
            self.inner_optimizer.step()

    def _synchronise(self) -> None:
        if self.outer_optimizer is None:
            super()._synchronise()
        elif isinstance(self._sync, StreamingSync):
            self._sync.sync(outer=self._outer_step)
        else:
            self._outer_step(self._sync, self._sync.average(dict(self._state_tensors())))
            self._sync.restart()

    def _outer_step(self, part: LocalSync, delta: Mapping[str, torch.Tensor]) -> None:
        """Step the given outer optimizer on the averaged pseudo-gradient ``delta``; update ``part.reference``.

        The optimizer steps its own tensors (the model's or the reference copies) with ``delta``
        as their gradient, and every other tensor of it (other fragments') without one; the
        schedule then restarts the weights from the new reference.
        """
        reference, params = part.reference, dict(self._named)
        targets = [(params[n] if self._outer_on_model else reference[n], n) for n in delta]
        mine = {id(t) for t, _ in targets}
        others = [p for g in self.outer_optimizer.param_groups for p in g["params"] if id(p) not in mine]
        # The model's own tensors step from θ_ref; the local weights come back for the mixing (α > 0) only.
        mixing = self._outer_on_model and isinstance(self._sync, StreamingSync) and self._sync.alpha > 0
        local = [params[n].clone() for _, n in targets] if mixing else []
        saved = [t.grad for t, _ in targets] + [p.grad for p in others]
        for target, name in targets:
            if self._outer_on_model:
                target.copy_(reference[name])
            target.grad = delta[name]
        for p in others:
            p.grad = None
        try:
            self.outer_optimizer.step()
        finally:
            for t, grad in zip([t for t, _ in targets] + others, saved):
                t.grad = grad  # the fused buffer behind delta is reused at the next sync
        if self._outer_on_model:
            for target, name in targets:
                reference[name].copy_(target)
            for (target, _), weights in zip(targets, local):
                target.copy_(weights)  # the local weights, for the schedule's mixing

    def schedule_state_bytes(self) -> int:
        """Return the bytes of the reference weights and outer momentum, and of a given inner/outer optimizer."""
        given = (o for o in (self.inner_optimizer, self.outer_optimizer) if o is not None)
        return super().schedule_state_bytes() + sum(state_nbytes(o) for o in given)

    def _extra_state(self) -> dict[str, Any]:
        extra = super()._extra_state()
        for key in ("inner_optimizer", "outer_optimizer"):
            opt = getattr(self, key)
            if opt is not None:
                extra[key] = opt.state_dict()
        return extra

    def _check_extra_state(self, extra: Mapping[str, Any]) -> None:
        saved, here = "fragments" in extra["schedule"], isinstance(self._sync, StreamingSync)
        if saved != here:
            raise ValueError(f"checkpoint was saved by DiLoCo {'with' if saved else 'without'} fragments "
                             f"(Streaming DiLoCo), this one is {'with' if here else 'without'}; build it as the "
                             "checkpoint's was (fragments, fragment_sync_delay, fragment_update_alpha) to resume")
        for key in ("inner_optimizer", "outer_optimizer"):
            if (getattr(self, key) is None) != (key not in extra):
                raise ValueError(f"checkpoint and optimizer disagree on {key} (one has it, the other not); "
                                 "build DiLoCo with the same inner and outer optimizers to resume")

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:
        for key in ("inner_optimizer", "outer_optimizer"):
            opt = getattr(self, key)
            if opt is not None:
                opt.load_state_dict(extra[key])
        super()._load_extra_state(extra)


def _repoint(optimizer: torch.optim.Optimizer, swap: Mapping[int, torch.Tensor]) -> None:
    """Make ``optimizer`` step ``swap[id(t)]`` instead of each of its tensors ``t`` listed, state included."""
    for group in optimizer.param_groups:
        group["params"] = [swap.get(id(p), p) for p in group["params"]]
    moved = {swap.get(id(p), p): state for p, state in optimizer.state.items()}
    optimizer.state.clear()
    optimizer.state.update(moved)


def _refuse_overrides(arg: str, given: Any, settings: dict[str, tuple[Any, Any]]) -> None:
    """Raise ValueError if ``given`` is set and a setting of the built-in optimizer it replaces is not its default."""
    if given is None:
        return
    changed = [name for name, (value, default) in settings.items() if value != default]
    if changed:
        raise ValueError(f"{', '.join(changed)} configure DiLoCo's built-in optimizer, which {arg}= replaces; "
                         f"set them on {arg} instead")


def _optimizer_over(arg: str, given: Any, factory_input: Any, tensors: list[torch.Tensor],
                    what: str) -> torch.optim.Optimizer:
    """Return ``given`` (or what the factory ``given`` builds from ``factory_input``), checked to own ``tensors``."""
    opt = given
    if not isinstance(given, torch.optim.Optimizer):
        if not callable(given) or isinstance(given, torch.nn.Module):
            raise TypeError(f"{arg} must be a torch.optim.Optimizer or a function that builds one from the "
                            f"parameters, got {type(given).__name__}")
        opt = given(factory_input)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"{arg} returned {type(opt).__name__}, not a torch.optim.Optimizer")
    theirs = [p for group in opt.param_groups for p in group["params"]]
    mine = {id(t) for t in tensors}
    foreign = sum(id(p) not in mine for p in theirs)
    missing = len(mine - {id(p) for p in theirs})
    if foreign or missing:
        raise ValueError(f"{arg} optimizes other tensors than {what} ({foreign} of its tensors are not among "
                         f"them, {missing} of them are not in it); build it over exactly those tensors")
    return opt


class LoRDO(_LocalOptimizer):
    """LoRDO: low-rank local Adam in a global subspace, full-rank QH term, sync every ``sync_every`` steps.

    The engine is :class:`commwire.schedules.LoRDOSchedule` (the update rule is
    :mod:`commwire.optim.lordo`'s module docstring); this class puts torch's optimizer interface on it:
    ``state[p]`` holds the per-parameter state (on the parameter's device), and
    ``state_dict()`` / ``load_state_dict()`` resume bit-identically. Each matrix
    parameter with ``rank < min(m, n)`` keeps Adam moments in a rank-r subspace
    whose basis is the top-r singular vectors of the averaged pseudo-gradient
    (computed identically on every rank, never sent); other parameters use
    AdamW (``projected_names`` lists the projected ones). The first basis comes
    from the first gradient, averaged once.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or param groups
            (per group: ``lr`` and ``weight_decay``; betas and eps are the optimizer's).
        lr, betas, eps, weight_decay: AdamW's.
        rank: r, the subspace dimension.
        sync_every: K (>= 1).
        omega: ω in [0, 1]; 1 − ω weights the full-rank QH term (1 = no QH term: stagnates).
        mu, qh_denominator: the QH term is Ĝ / (μ·D(den)), D "scalar" or "broadcast".
        clip: ρ, clip the gradient to this global norm first (default 0.5; None: off).
        error_feedback: "full" (m x n buffer), "lowrank" (rank r: O(r(m+n)) state) or "none"
            (True/False: full/none).
        rotate: rotate the moments into each new basis.
        sync_states: states averaged at each sync, from ("moments", "error_feedback").
        warmup_steps: DDP warm-up steps (gradients averaged every step; a multiple of ``sync_every``).
        warmup_omega, switch_betas, switch_reset_moments, switch_lr_scale: what changes when
            the warm-up ends (the authors': ω, (0.999, 0.999), True, 0.5).
        outer_lr, outer_momentum, nesterov: outer step (default plain averaging).
        codec: wire format of the pseudo-gradients; state_codec: of the averaged states.
        comm: communicator (default: the world).
        check: verify that the parameters are identical on every rank.

    Example:
        >>> opt = LoRDO(model.named_parameters(), lr=2e-3, rank=32, sync_every=32, omega=0.97, codec="fp8-e4m3")
        >>> opt.stats()["bytes"]["per_step"], opt.stats()["memory"]["total"]
    """

    def __init__(self, params: Any, lr: float = 1e-3, *, rank: int, sync_every: int = 32, omega: float = 0.97,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 1e-5,
                 mu: float = 1.0, qh_denominator: str = "scalar", clip: float | None = 0.5,
                 error_feedback: bool | str = "full", rotate: bool = True,
                 sync_states: tuple[str, ...] = ("moments",), warmup_steps: int = 0,
                 warmup_omega: float | None = None, switch_betas: tuple[float, float] | None = None,
                 switch_reset_moments: bool = False, switch_lr_scale: float = 1.0, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, nesterov: bool = True, codec: Any = None, state_codec: Any = None,
                 comm: Communicator | None = None, check: bool = True) -> None:
        _check_adam(lr, betas, eps, weight_decay)
        self.config = LoRDOConfig(
            rank=rank, omega=omega, betas=tuple(betas), eps=eps, weight_decay=weight_decay, mu=mu,
            qh_denominator=qh_denominator, clip=clip, error_feedback=error_feedback, rotate=rotate,
            sync_states=tuple(sync_states), warmup_steps=warmup_steps, warmup_omega=warmup_omega,
            switch_betas=tuple(switch_betas) if switch_betas is not None else None,
            switch_reset_moments=switch_reset_moments, switch_lr_scale=switch_lr_scale)
        schedule = LocalSyncConfig(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum,
                                   nesterov=nesterov, codec=codec, state_codec=state_codec)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, schedule, comm, check)

    def _schedule(self, named: list[tuple[str, torch.Tensor]], schedule: LocalSyncConfig,
                  check: bool) -> LocalSync:
        for group in self.param_groups:
            if (tuple(group["betas"]), group["eps"]) != (self.config.betas, self.config.eps):
                raise ValueError(f"a param group sets betas={group['betas']}, eps={group['eps']}; LoRDO takes "
                                 f"them for all groups ({self.config.betas}, {self.config.eps}): pass them to LoRDO")
        self._engine = LoRDOSchedule(named, self.config, schedule, comm=self.comm, check=check,
                                     states={n: self.state[p] for n, p in named})
        return self._engine.schedule

    @property
    def diagnostics(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Return one entry per sync: subspace similarity and numerical rank of Δ per projected matrix."""
        return self._engine.diagnostics if hasattr(self, "_engine") else []

    @diagnostics.setter
    def diagnostics(self, value: list[dict[str, Any]]) -> None:
        if hasattr(self, "_engine"):
            self._engine.diagnostics = value

    @property
    def projected_names(self) -> list[str]:
        """Return the names of the parameters with low-rank moments."""
        return self._engine.projected_names

    @property
    def bootstrap_bytes(self) -> int:
        """Return the bytes of the one-time first-gradient all-reduce that seeds the bases."""
        return self._engine.bootstrap_bytes

    def stats(self) -> dict[str, Any]:
        """Return what this optimizer sends ("bytes": sent so far, per sync, per step) and holds ("memory")."""
        return self._engine.stats()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Take one step; during a warm-up average the gradients first; every ``sync_every``-th step, sync."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lrs = {self._names[p]: g["lr"] for g in self.param_groups for p in g["params"]}
        decay = {self._names[p]: g["weight_decay"] for g in self.param_groups for p in g["params"]}
        self._engine.step({name: grad for name, grad, _ in self._gradients()}, lrs, decay)
        return loss

    def _extra_state(self) -> dict[str, Any]:
        return self._engine.extra_state()

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:
        # torch's load_state_dict made new per-parameter dicts: the engine works on those now.
        self._engine.state = {n: self.state[p] for n, p in self._named}
        self._engine.load_extra_state(extra)


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
        positive_int("refresh_every", refresh_every)
        self.config = LoRDOConfig(rank=rank, omega=1.0, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                  clip=None, error_feedback=False, rotate=rotate, sync_states=())
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
                              weight_decay=group["weight_decay"], clip=None, error_feedback=False,
                              rotate=self.config.rotate, sync_states=())
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
                    lowrank_step(p, p.grad, state, lr=group["lr"], config=cfg, phase=cfg.phase(t))
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
