"""LoRDO math: low-rank Adam in a global rank-r subspace, error feedback and a full-rank QH term.

Per projected m x n matrix (Jovanović et al., arXiv 2602.04396). The basis Q
(d x r, orthonormal columns) lives on the smaller side d = min(m, n), so the
low-rank moments are r x n (m <= n: "left", g = QᵀA) or m x r (m > n:
"right", g = AQ) and hold 2·r·max(m, n) numbers instead of Adam's 2mn.

Local step on a worker, with A = G + E (E: error feedback)::

    g = project(Q, A);  E = A − back(Q, g)
    u = b1·u + (1−b1)·g;  v = b2·v + (1−b2)·g²;  den = sqrt(v̂) + eps
    θ −= lr·[(1−ω)·A / mean(den) + ω·back(Q, û / den)];  θ −= lr·wd·θ

At a sync the new basis is the top-r left (or right) singular vectors of the
averaged pseudo-gradient Δ. Every rank holds the same Δ, so every rank computes
the same Q and Q never travels. The moments are rotated into the new basis
with T = Q_newᵀ Q_old: u ← T u, v ← (T∘T) v (the variance of a linear mix of
independent coordinates), so Adam's memory survives the refresh.

The functions work on numpy arrays and torch tensors alike (2-D parameters,
state kept in a plain dict), so the torch optimizers are thin loops over them;
:class:`LoRDO` runs the whole method on named arrays of either kind.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "LoRDO",
    "LoRDOConfig",
    "SYNC_STATES",
    "Refresh",
    "adam_step",
    "back",
    "init_adam_state",
    "init_lowrank_state",
    "is_projected",
    "lowrank_bootstrap",
    "lowrank_state_values",
    "lowrank_step",
    "numerical_rank",
    "project",
    "refresh_basis",
    "subspace_similarity",
    "top_basis",
]

SYNC_STATES = ("moments", "error_feedback")
"""Optimizer states LoRDO may average at a sync: low-rank (and non-matrix) Adam moments, EF buffers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoRDOConfig:
    """Hyperparameters of the LoRDO local update (the sync schedule is a LocalSyncConfig)."""

    rank: int
    """r: dimension of the subspace of each projected matrix (a matrix with min(m, n) <= r stays full rank)."""
    omega: float = 0.97
    """ω: weight of the low-rank Adam term; 1 − ω weights the full-rank QH term (1 = pure low-rank, stagnates)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's (b1, b2)."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 1e-5
    """Decoupled weight decay."""
    clip: float | None = None
    """ρ: clip each gradient matrix to this Frobenius norm before use (None: no clipping)."""
    error_feedback: bool = True
    """Keep E, the part of each update the projection lost, and add it to the next gradient."""
    rotate: bool = True
    """Rotate the moments into the new basis at a refresh (else keep them as they are)."""
    sync_states: tuple[str, ...] = ("moments",)
    """States averaged at every sync, a subset of SYNC_STATES (each costs bytes; see bytes_per_sync)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) or self.rank < 1:
            raise ValueError(f"rank={self.rank!r} must be an integer >= 1 (e.g. d_model/4)")
        if not 0.0 <= self.omega <= 1.0:
            raise ValueError(f"omega={self.omega} must lie in [0, 1] (0.97 is a good start; 1 stagnates)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas} must be two values in [0, 1), e.g. (0.9, 0.95)")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps} must be > 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip={self.clip} must be > 0 or None")
        bad = [s for s in self.sync_states if s not in SYNC_STATES]
        if bad:
            raise ValueError(f"sync_states={self.sync_states} has unknown {bad}; choose from {SYNC_STATES}")
        if "error_feedback" in self.sync_states and not self.error_feedback:
            raise ValueError("sync_states includes 'error_feedback' but error_feedback=False; drop one of them")


@dataclass(frozen=True, slots=True)
class Refresh:
    """What one basis refresh saw: subspace similarity to the old basis and the rank of Δ."""

    similarity: float
    """Mean squared singular value of Q_newᵀ Q_old (1 = same subspace, 0 = orthogonal)."""
    numerical_rank: int
    """Singular values of Δ above σ_max · max(m, n) · eps(dtype) (numpy's matrix_rank rule)."""


# ------------------------------------------------------------------ array ops
def _xp(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return np
    import torch

    return torch


def _svd(x: Any) -> tuple[Any, Any, Any]:
    return _xp(x).linalg.svd(x, full_matrices=False)


def _left(shape: tuple[int, ...]) -> bool:
    return shape[0] <= shape[1]


def _zeros(like: Any, shape: tuple[int, ...]) -> Any:
    if isinstance(like, np.ndarray):
        return np.zeros(shape, dtype=like.dtype)
    return like.new_zeros(shape)


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


def numerical_rank(singular_values: Any, shape: tuple[int, ...]) -> int:
    """Return how many singular values exceed σ_max · max(shape) · eps (numpy's matrix_rank rule)."""
    s = singular_values
    if s.shape[0] == 0:
        return 0
    eps = float(np.finfo(np.float32 if str(s.dtype).endswith("float32") else np.float64).eps)
    tol = float(s.max()) * max(shape) * eps
    return int((s > tol).sum())


# ------------------------------------------------------------------ full Adam
def init_adam_state(param: Any) -> dict[str, Any]:
    """Return zero Adam moments for ``param``."""
    return {"exp_avg": _zeros(param, tuple(param.shape)), "exp_avg_sq": _zeros(param, tuple(param.shape))}


def adam_step(param: Any, grad: Any, state: MutableMapping[str, Any], *, lr: float, step: int,
              betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Apply one AdamW update to ``param`` in place (``step`` counts from 1)."""
    b1, b2 = betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m *= b1
    m += (1 - b1) * grad
    v *= b2
    v += (1 - b2) * grad * grad
    den = _xp(v).sqrt(v / (1 - b2 ** step)) + eps
    param -= (lr / (1 - b1 ** step)) * m / den
    if weight_decay:
        param -= (lr * weight_decay) * param


# ------------------------------------------------------------- low-rank Adam
def init_lowrank_state(param: Any, rank: int, *, error_feedback: bool) -> dict[str, Any]:
    """Return zero low-rank moments, a zero basis and (optionally) a zero EF buffer for a matrix."""
    m, n = tuple(param.shape)
    low = (rank, n) if _left((m, n)) else (m, rank)
    state = {"basis": _zeros(param, (min(m, n), rank)), "exp_avg": _zeros(param, low), "exp_avg_sq": _zeros(param, low)}
    if error_feedback:
        state["error"] = _zeros(param, (m, n))
    return state


def lowrank_state_values(shape: tuple[int, ...], rank: int, *, error_feedback: bool) -> int:
    """Return the numbers held per matrix: 2·r·max(m, n) moments + r·min(m, n) basis (+ mn EF)."""
    m, n = shape
    return 2 * rank * max(m, n) + rank * min(m, n) + (m * n if error_feedback else 0)


def lowrank_step(param: Any, grad: Any, state: MutableMapping[str, Any], *, lr: float, step: int,
                 config: LoRDOConfig) -> None:
    """Apply one LoRDO local update to the matrix ``param`` in place (``step`` counts from 1)."""
    xp = _xp(param)
    shape = tuple(param.shape)
    b1, b2 = config.betas
    if config.clip is not None:
        norm = float((grad * grad).sum()) ** 0.5
        if norm > config.clip:
            grad = grad * (config.clip / norm)
    error = state.get("error")
    full = grad + error if error is not None else grad
    basis = state["basis"]
    g = project(basis, full)
    if error is not None:
        error[...] = full - back(basis, g, shape)
    u, v = state["exp_avg"], state["exp_avg_sq"]
    u *= b1
    u += (1 - b1) * g
    v *= b2
    v += (1 - b2) * g * g
    den = xp.sqrt(v / (1 - b2 ** step)) + config.eps
    omega = config.omega
    low = back(basis, (u / (1 - b1 ** step)) / den, shape)
    if omega < 1.0:
        # The QH term is normalised by one scalar (the mean Adam denominator), so it costs no
        # full-rank second moment: memory stays low-rank while the update stays full-rank.
        param -= (lr * (1 - omega) / float(den.mean())) * full
    param -= (lr * omega) * low
    if config.weight_decay:
        param -= (lr * config.weight_decay) * param


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



class LoRDO:
    """Run LoRDO on named arrays (numpy or torch): local low-rank steps, a LocalSync every K steps.

    The framework-free form of ``commwire.torch.LoRDO`` (same math, same
    schedule): call :meth:`step` with this rank's gradients once per step.

    Args:
        params: ``(name, array)`` pairs, the live weights, identical on every rank.
        config: the LoRDO hyperparameters.
        schedule: the sync schedule (default: every 32 steps, plain averaging).
        comm: communicator (default: the world).
        check: verify that ``params`` are identical on every rank.

    Example:
        >>> opt = LoRDO([("w", w)], LoRDOConfig(rank=4), LocalSyncConfig(sync_every=16))
        >>> synced = opt.step({"w": grad_w}, lr=1e-3)
    """

    def __init__(self, params: Any, config: LoRDOConfig, schedule: Any = None, *, comm: Any = None,
                 check: bool = True) -> None:
        from .local import LocalSync

        self.params = list(params)
        self.config = config
        self.state = {name: init_lowrank_state(x, config.rank, error_feedback=config.error_feedback)
                      if is_projected(tuple(x.shape), config.rank) else init_adam_state(x)
                      for name, x in self.params}
        self.schedule = LocalSync(self.params, schedule, comm=comm, states=self.synced_states(), check=check)
        self.diagnostics: list[dict[str, Any]] = []

    def synced_states(self) -> list[tuple[str, Any]]:
        """Return the ``(name, array)`` states that ``config.sync_states`` averages at a sync."""
        keys = (("exp_avg", "exp_avg_sq") if "moments" in self.config.sync_states else ()) + \
               (("error",) if "error_feedback" in self.config.sync_states else ())
        return [(f"{n}.{k}", self.state[n][k]) for n, _ in self.params for k in keys if k in self.state[n]]

    def step(self, grads: Any, lr: float) -> bool:
        """Apply one local step with ``{name: gradient}``; sync when due and return whether it did."""
        t = self.schedule.steps + 1
        if t == 1:
            self._bootstrap(grads)
        c = self.config
        for name, x in self.params:
            g = grads.get(name)
            if g is None:
                continue
            if "basis" in self.state[name]:
                lowrank_step(x, g, self.state[name], lr=lr, step=t, config=c)
            else:
                adam_step(x, g, self.state[name], lr=lr, step=t, betas=c.betas, eps=c.eps,
                          weight_decay=c.weight_decay)
        if not self.schedule.tick():
            return False
        delta = self.schedule.sync(dict(self.synced_states()))
        similarity, ranks = {}, {}
        for name, _ in self.params:
            if "basis" in self.state[name]:
                report = refresh_basis(self.state[name], delta[name], c.rank, rotate=c.rotate)
                similarity[name], ranks[name] = report.similarity, report.numerical_rank
        self.diagnostics.append({"step": self.schedule.steps, "similarity": similarity, "rank": ranks})
        return True

    def _bootstrap(self, grads: Any) -> None:
        # The first basis must be the same everywhere: average the first gradients once.
        projected = [(n, x) for n, x in self.params if "basis" in self.state[n]]
        if not projected:
            return
        from .local import _fusion

        fb = _fusion(projected, self.schedule.comm, None)
        for name, x in projected:
            g = grads.get(name)
            fb.view(name)[...] = g if g is not None else 0
            fb.mark(name)
        averaged = fb.wait()
        for name, _ in projected:
            lowrank_bootstrap(self.state[name], averaged[name], self.config.rank)
