"""LoRDO math: low-rank Adam in a global rank-r subspace, error feedback and a full-rank QH term.

Per projected m x n matrix (Jovanović et al., arXiv 2602.04396; the update rule
of the public re-derivation). The basis Q (d x r, orthonormal columns) lives on
the smaller side d = min(m, n), so the low-rank moments are r x n (m <= n:
"left", g = QᵀA) or m x r (m > n: "right", g = AQ) and hold 2·r·max(m, n)
numbers instead of Adam's 2mn. A local step on a worker::

    Ĝ = clip(∇F, ρ)                                  (ρ: the global norm over all parameters)
    g = project(Q, Ĝ + E);  E = Ĝ + E − back(Q, g)    (E: error feedback; it feeds the projection only)
    u = b1·u + (1−b1)·g;  v = b2·v + (1−b2)·g²;  den = sqrt(v̂) + eps
    θ −= lr·[(1−ω)·Ĝ / (μ·D(den)) + ω·back(Q, û / den)];  θ −= lr·wd·θ

The full-rank quasi-hyperbolic (QH) term uses the clipped gradient Ĝ alone: with
Ĝ + E there, every past projection residual would be applied again at every
step (with a fixed Q and a constant gradient the out-of-subspace displacement
after K steps grows (K+1)/2-fold). D maps the r-dimensional den onto the m x n
gradient: "scalar" (its mean: one number per matrix) or "broadcast" (its mean
over the r projected coordinates, broadcast along the projected side: a row
vector 1 x n for "left", a column m x 1 for "right"). E is kept in full
(m x n), as a rank-r factorisation P Rᵀ refreshed by one warm-started power
step (PowerSGD's compressor: r·(m + n) numbers, so the optimizer state of the
matrix really is O(r·(m + n))), or not at all.

At a sync the new basis is the top-r left (or right) singular vectors of the
averaged pseudo-gradient Δ. Every rank holds the same Δ, so every rank computes
the same Q and Q never travels. The moments are rotated into the new basis
with T = Q_newᵀ Q_old: u ← T u, v ← (T∘T) v (the variance of a linear mix of
independent coordinates), so Adam's memory survives the refresh.

The authors' runs start with a DDP warm-up (gradients averaged every step; the
basis still refreshed every K steps, from the identical local Δ, with no
message) and then switch betas (0.9, 0.95) -> (0.999, 0.999), reset the moments
and halve the LR: ``warmup_steps``, ``warmup_omega``, ``switch_betas``,
``switch_reset_moments`` and ``switch_lr_scale`` reproduce that; bias
corrections follow the betas actually used (1 − Π b).

The functions work on numpy arrays and torch tensors alike (2-D parameters,
state kept in a plain dict, every state tensor on its parameter's device).
They hold no schedule: :class:`commwire.schedules.LoRDOSchedule` runs the whole
method (local steps, syncs, basis refreshes) on named arrays of either kind, and
``commwire.torch.LoRDO`` puts torch's optimizer interface on that.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validate import positive_int
from ..comm.arrays import array_module, zeros

__all__ = [
    "ERROR_FEEDBACK",
    "LoRDOConfig",
    "Phase",
    "QH_DENOMINATORS",
    "RANK_RTOL",
    "SYNC_STATES",
    "Refresh",
    "adam_step",
    "back",
    "clip_factor",
    "init_adam_state",
    "init_lowrank_state",
    "is_projected",
    "lowrank_bootstrap",
    "lowrank_state_values",
    "lowrank_step",
    "numerical_rank",
    "project",
    "qh_denominator",
    "refresh_basis",
    "state_category",
    "subspace_similarity",
    "top_basis",
]

SYNC_STATES = ("moments", "error_feedback")
"""Optimizer states LoRDO may average at a sync: low-rank (and non-matrix) Adam moments, EF buffers."""
ERROR_FEEDBACK = ("full", "lowrank", "none")
"""How E is kept: an m x n buffer, a rank-r factorisation P Rᵀ (r·(m + n) numbers), or not at all."""
QH_DENOMINATORS = ("scalar", "broadcast")
"""How the low-rank Adam denominator normalises the full-rank QH term (see the module docstring)."""
_EF_KEYS = ("error", "error_p", "error_r")


def _betas_ok(betas: Any) -> bool:
    return len(tuple(betas)) == 2 and all(0.0 <= b < 1.0 for b in betas)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoRDOConfig:
    """Hyperparameters of the LoRDO local update (the sync schedule is a LocalSyncConfig)."""

    rank: int
    """r: dimension of the subspace of each projected matrix (a matrix with min(m, n) <= r stays full rank)."""
    omega: float = 0.97
    """ω: weight of the low-rank Adam term; 1 − ω weights the full-rank QH term (1 = pure low-rank, stagnates)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's (b1, b2) (until the switch, if any)."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 1e-5
    """Decoupled weight decay."""
    mu: float = 1.0
    """μ: the QH term is divided by μ·D(den) (the authors' code uses 1)."""
    qh_denominator: str = "scalar"
    """D: "scalar" (mean of den) or "broadcast" (mean over the r coordinates, broadcast along the projected side)."""
    clip: float | None = 0.5
    """ρ: clip the gradient to this global norm (over all parameters of the optimizer) first; None: off.
    0.5 is the max_norm of the authors' runs."""
    error_feedback: str = "full"
    """E: "full" (m x n), "lowrank" (rank-r P Rᵀ: O(r(m+n)) state) or "none"; True/False mean full/none."""
    rotate: bool = True
    """Rotate the moments into the new basis at a refresh (else keep them as they are)."""
    sync_states: tuple[str, ...] = ("moments",)
    """States averaged at every sync, a subset of SYNC_STATES (each costs bytes; see bytes_per_sync)."""
    warmup_steps: int = 0
    """DDP warm-up: the first steps average the gradients every step (no local divergence; a multiple of K)."""
    warmup_omega: float | None = None
    """ω during the warm-up (None: omega; 1 = low-rank DDP)."""
    switch_betas: tuple[float, float] | None = None
    """Betas after the warm-up (the authors' runs: (0.999, 0.999)); None: keep betas."""
    switch_reset_moments: bool = False
    """Zero every Adam moment when the warm-up ends (the authors' runs do)."""
    switch_lr_scale: float = 1.0
    """Multiply the LR by this after the warm-up (the authors' runs: 0.5)."""

    def __post_init__(self) -> None:
        positive_int("rank", self.rank, extra="(e.g. d_model/4)")
        for name in ("omega",) + (("warmup_omega",) if self.warmup_omega is not None else ()):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must lie in [0, 1] (0.97 is a good start; "
                                 "1 stagnates)")
        for name in ("betas",) + (("switch_betas",) if self.switch_betas is not None else ()):
            if not _betas_ok(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)} must be two values in [0, 1), e.g. (0.9, 0.95)")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps} must be > 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")
        if not self.mu > 0:
            raise ValueError(f"mu={self.mu} must be > 0 (1 is the authors' value)")
        if self.qh_denominator not in QH_DENOMINATORS:
            raise ValueError(f"qh_denominator={self.qh_denominator!r} must be one of {QH_DENOMINATORS}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip={self.clip} must be > 0 or None (0.5 is the authors' max_norm)")
        ef = {True: "full", False: "none"}.get(self.error_feedback, self.error_feedback)  # type: ignore[call-overload]
        if ef not in ERROR_FEEDBACK:
            raise ValueError(f"error_feedback={self.error_feedback!r} must be one of {ERROR_FEEDBACK} (or a bool)")
        object.__setattr__(self, "error_feedback", ef)
        bad = [s for s in self.sync_states if s not in SYNC_STATES]
        if bad:
            raise ValueError(f"sync_states={self.sync_states} has unknown {bad}; choose from {SYNC_STATES}")
        if "error_feedback" in self.sync_states and ef != "full":
            raise ValueError(f"sync_states includes 'error_feedback' but error_feedback={ef!r}: only a full "
                             "buffer can be averaged; drop one of them")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, (int, np.integer)) \
                or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if not self.switch_lr_scale > 0:
            raise ValueError(f"switch_lr_scale={self.switch_lr_scale} must be > 0")
        switch = (self.switch_betas is not None or self.switch_reset_moments or self.switch_lr_scale != 1.0
                  or self.warmup_omega is not None)
        if switch and not self.warmup_steps:
            raise ValueError("switch_betas / switch_reset_moments / switch_lr_scale / warmup_omega act when the "
                             "warm-up ends, but warmup_steps=0; set warmup_steps (or use betas= and omega=)")

    def phase(self, step: int) -> Phase:
        """Return the betas, ω, bias corrections and LR factor in force at ``step`` (counting from 1)."""
        w = int(self.warmup_steps)
        b1, b2 = self.betas
        if step <= w:
            return Phase(warmup=True, betas=(b1, b2), omega=self.omega if self.warmup_omega is None
                         else self.warmup_omega, bias=(1 - b1 ** step, 1 - b2 ** step), lr_scale=1.0, starts=False)
        n1, n2 = self.switch_betas if self.switch_betas is not None else self.betas
        k = step - w
        # Moments are sums of (1 − b_i)·g_i weighted by later betas: the weights add up to 1 − Π b.
        p1, p2 = (1.0, 1.0) if self.switch_reset_moments else (b1 ** w, b2 ** w)
        return Phase(warmup=False, betas=(n1, n2), omega=self.omega, bias=(1 - p1 * n1 ** k, 1 - p2 * n2 ** k),
                     lr_scale=self.switch_lr_scale, starts=w > 0 and k == 1)


@dataclass(frozen=True, slots=True)
class Phase:
    """What one step uses: from :meth:`LoRDOConfig.phase`."""

    warmup: bool
    """Whether the step belongs to the DDP warm-up (gradients averaged first)."""
    betas: tuple[float, float]
    omega: float
    bias: tuple[float, float]
    """Bias corrections (1 − Π b1, 1 − Π b2) of the moments after this step."""
    lr_scale: float
    starts: bool
    """Whether this is the first step after the warm-up (where the moments may be reset)."""


@dataclass(frozen=True, slots=True)
class Refresh:
    """What one basis refresh saw: subspace similarity to the old basis and the rank of Δ."""

    similarity: float
    """Mean squared singular value of Q_newᵀ Q_old (1 = same subspace, 0 = orthogonal)."""
    numerical_rank: int
    """Singular values of Δ above σ_max · max(RANK_RTOL, max(m, n) · eps(dtype)) (see numerical_rank)."""


# ------------------------------------------------------------------ array ops
def _svd(x: Any) -> tuple[Any, Any, Any]:
    return array_module(x).linalg.svd(x, full_matrices=False)


def _left(shape: tuple[int, ...]) -> bool:
    return shape[0] <= shape[1]


def _like(like: Any, values: np.ndarray) -> Any:
    """Return ``values`` as an array of ``like``'s kind, dtype and device."""
    if isinstance(like, np.ndarray):
        return values.astype(like.dtype)
    import torch

    return torch.as_tensor(values, dtype=like.dtype, device=like.device)


def _mean_keep(x: Any, axis: int) -> Any:
    if isinstance(x, np.ndarray):
        return x.mean(axis=axis, keepdims=True)
    return x.mean(dim=axis, keepdim=True)


def is_projected(shape: tuple[int, ...], rank: int) -> bool:
    """Return whether a parameter of ``shape`` gets low-rank moments (2-D with rank < min(m, n))."""
    return len(shape) == 2 and rank < min(shape)


def project(basis: Any, x: Any) -> Any:
    """Return the r-dimensional coordinates of ``x`` in ``basis`` (QᵀX or XQ, by shape)."""
    return basis.T @ x if _left(tuple(x.shape)) else x @ basis


def back(basis: Any, g: Any, shape: tuple[int, ...]) -> Any:
    """Map low-rank coordinates ``g`` back to a matrix of ``shape`` (Qg or gQᵀ)."""
    return basis @ g if _left(shape) else g @ basis.T


def top_basis(delta: Any, rank: int) -> tuple[Any, Any]:
    """Return the top-``rank`` singular vectors of ``delta`` on its smaller side, and all singular values."""
    u, s, vh = _svd(delta)
    basis = u[:, :rank] if _left(tuple(delta.shape)) else vh[:rank].T
    return basis, s


def subspace_similarity(new: Any, old: Any) -> float:
    """Return the mean squared singular value of newᵀ old (= ‖newᵀ old‖²_F / r)."""
    t = new.T @ old
    return float((t * t).sum()) / new.shape[1]


RANK_RTOL = 1e-4
"""Singular values of Δ at or below RANK_RTOL · σ_max do not count towards its numerical rank."""


def numerical_rank(singular_values: Any, shape: tuple[int, ...]) -> int:
    """Return how many singular values exceed σ_max · max(RANK_RTOL, max(shape) · eps).

    numpy's matrix_rank rule alone (σ_max · max(shape) · eps) is too strict for Δ:
    Δ = θ_ref − θ is a difference of weights much larger than Δ, so its rounding
    error reaches 1e-6 · σ_max in float32 and would count as extra rank.
    """
    s = singular_values
    if s.shape[0] == 0:
        return 0
    eps = float(np.finfo(np.float32 if str(s.dtype).endswith("float32") else np.float64).eps)
    tol = float(s.max()) * max(RANK_RTOL, max(shape) * eps)
    return int((s > tol).sum())


def clip_factor(grads: Iterable[Any], rho: float | None) -> Any:
    """Return the factor min(1, ρ / ‖grads‖) that clips ``grads`` to global norm ``rho`` (1 for None).

    For torch tensors the factor is a 0-d tensor on the first gradient's device
    (no host synchronisation); for numpy arrays a float.
    """
    grads = [g for g in grads if g is not None]
    if rho is None or not grads:
        return 1.0
    if isinstance(grads[0], np.ndarray):
        norm = float(np.sqrt(sum(float((g * g).sum()) for g in grads)))
        return min(1.0, rho / (norm + 1e-6))
    import torch

    dev = grads[0].device
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).to(dev) for g in grads]))
    return torch.clamp(rho / (norm + 1e-6), max=1.0)  # 1e-6 as torch.nn.utils.clip_grad_norm_


# ------------------------------------------------------------------ full Adam
def init_adam_state(param: Any) -> dict[str, Any]:
    """Return zero Adam moments for ``param``."""
    return {"exp_avg": zeros(param, tuple(param.shape)), "exp_avg_sq": zeros(param, tuple(param.shape))}


def adam_step(param: Any, grad: Any, state: MutableMapping[str, Any], *, lr: float, step: int,
              betas: tuple[float, float], eps: float, weight_decay: float,
              bias: tuple[float, float] | None = None) -> None:
    """Apply one AdamW update to ``param`` in place (``step`` counts from 1; ``bias`` overrides 1 − b^step)."""
    b1, b2 = betas
    c1, c2 = bias if bias is not None else (1 - b1 ** step, 1 - b2 ** step)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m *= b1
    m += (1 - b1) * grad
    v *= b2
    v += (1 - b2) * grad * grad
    den = array_module(v).sqrt(v / c2) + eps
    param -= (lr / c1) * m / den
    if weight_decay:
        param -= (lr * weight_decay) * param


# ------------------------------------------------------------- low-rank Adam
def _ef_mode(error_feedback: Any) -> str:
    return {True: "full", False: "none"}.get(error_feedback, error_feedback)


def init_lowrank_state(param: Any, rank: int, *, error_feedback: Any) -> dict[str, Any]:
    """Return zero low-rank moments, a zero basis and the EF state ("full"/"lowrank"/"none") for a matrix."""
    m, n = tuple(param.shape)
    low = (rank, n) if _left((m, n)) else (m, rank)
    state = {"basis": zeros(param, (min(m, n), rank)), "exp_avg": zeros(param, low), "exp_avg_sq": zeros(param, low)}
    mode = _ef_mode(error_feedback)
    if mode == "full":
        state["error"] = zeros(param, (m, n))
    elif mode == "lowrank":
        state["error_p"] = zeros(param, (m, rank))
        # The power step starts from a fixed dense R (the same on every rank, any device).
        start = np.random.default_rng(m * 100_003 + n).standard_normal((n, rank)) / np.sqrt(n)
        state["error_r"] = _like(param, start)
    return state


def lowrank_state_values(shape: tuple[int, ...], rank: int, *, error_feedback: Any) -> int:
    """Return the numbers held per matrix: 2·r·max(m, n) moments + r·min(m, n) basis + EF (mn, r(m+n) or 0)."""
    m, n = shape
    ef = {"full": m * n, "lowrank": rank * (m + n), "none": 0}[_ef_mode(error_feedback)]
    return 2 * rank * max(m, n) + rank * min(m, n) + ef


def qh_denominator(den: Any, shape: tuple[int, ...], mode: str) -> Any:
    """Return D(den): how the r-dimensional Adam denominator divides the m x n QH term."""
    if mode == "scalar":
        return den.mean()
    # den is r x n (left) or m x r (right): average out the r coordinates, keep the other side.
    return _mean_keep(den, 0 if _left(shape) else 1)


def _error_value(state: Mapping[str, Any]) -> Any:
    if "error" in state:
        return state["error"]
    if "error_p" in state:
        return state["error_p"] @ state["error_r"].T
    return None


def _store_error(state: MutableMapping[str, Any], residual: Any) -> None:
    if "error" in state:
        state["error"][...] = residual
        return
    # One warm-started power step (PowerSGD): P = orth(X R), R = Xᵀ P, so X ≈ P Rᵀ with r(m+n) numbers.
    p = array_module(residual).linalg.qr(residual @ state["error_r"])[0]
    state["error_p"][...] = p
    state["error_r"][...] = residual.T @ p


def lowrank_step(param: Any, grad: Any, state: MutableMapping[str, Any], *, lr: float, config: LoRDOConfig,
                 phase: Phase, weight_decay: float | None = None) -> None:
    """Apply one LoRDO local update to the matrix ``param`` in place; ``grad`` is the clipped gradient Ĝ."""
    xp = array_module(param)
    shape = tuple(param.shape)
    b1, b2 = phase.betas
    c1, c2 = phase.bias
    error = _error_value(state)
    basis = state["basis"]
    full = grad + error if error is not None else grad
    g = project(basis, full)
    if error is not None:
        _store_error(state, full - back(basis, g, shape))
    u, v = state["exp_avg"], state["exp_avg_sq"]
    u *= b1
    u += (1 - b1) * g
    v *= b2
    v += (1 - b2) * g * g
    den = xp.sqrt(v / c2) + config.eps
    omega = phase.omega
    param -= (lr * omega) * back(basis, (u / c1) / den, shape)
    if omega < 1.0:
        # The QH term is Ĝ alone (E feeds the projection only), normalised by the low-rank
        # denominator: no full-rank second moment, so memory stays low-rank, the update full-rank.
        param -= (lr * (1 - omega) / config.mu) * (grad / qh_denominator(den, shape, config.qh_denominator))
    wd = config.weight_decay if weight_decay is None else weight_decay
    if wd:
        param -= (lr * wd) * param


def refresh_basis(state: MutableMapping[str, Any], delta: Any, rank: int, *, rotate: bool = True) -> Refresh:
    """Replace the basis by the top-``rank`` singular vectors of ``delta``; rotate the moments into it."""
    old = state["basis"]
    new, singular = top_basis(delta, rank)
    report = Refresh(similarity=subspace_similarity(new, old),
                     numerical_rank=numerical_rank(singular, tuple(delta.shape)))
    if rotate:
        t = new.T @ old
        left = _left(tuple(delta.shape))
        u, v = state["exp_avg"], state["exp_avg_sq"]
        u[...] = t @ u if left else u @ t.T
        # Elementwise-squared T keeps v non-negative: v is a per-coordinate variance.
        v[...] = (t * t) @ v if left else v @ (t * t).T
    old[...] = new
    return report


def lowrank_bootstrap(state: MutableMapping[str, Any], grad: Any, rank: int) -> None:
    """Set the first basis from an (averaged) gradient; the moments are still zero."""
    state["basis"][...] = top_basis(grad, rank)[0]


def state_category(key: str, projected: bool) -> str:
    """Return what a per-parameter state entry is: "error_feedback", "basis", "lowrank_moments" or "adam_moments"."""
    if key in _EF_KEYS:
        return "error_feedback"
    if key == "basis":
        return "basis"
    return "lowrank_moments" if projected else "adam_moments"
