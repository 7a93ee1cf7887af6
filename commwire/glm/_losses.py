"""The three GLM losses: codes shared with the kernels, label checks, vectorised reference."""

from __future__ import annotations

from typing import Any

import numpy as np

LEAST_SQUARES, LOGISTIC, POISSON = 0, 1, 2
CODES = {"least_squares": LEAST_SQUARES, "logistic": LOGISTIC, "poisson": POISSON}
_ALIASES = {"squared_error": "least_squares", "ls": "least_squares", "log_loss": "logistic"}


def loss_code(name: str) -> int:
    """Return the kernel code of a loss name."""
    key = _ALIASES.get(name, name) if isinstance(name, str) else name
    if key not in CODES:
        raise ValueError(f"loss={name!r} is not supported; choose one of {list(CODES)}")
    return CODES[key]


def check_labels(code: int, y: Any) -> np.ndarray:
    """Return float64 labels the kernels use (logistic: +-1), or raise naming the bad values."""
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"y must be 1-D, got shape {y.shape}")
    if y.dtype.kind not in "biuf":
        raise ValueError(f"y has dtype {y.dtype}; numeric labels are needed")
    y = y.astype(np.float64)
    bad = ~np.isfinite(y)
    if bad.any():
        raise ValueError(f"y holds {int(bad.sum())} NaN/Inf values (first at index {int(np.argmax(bad))}); "
                         f"remove or impute them")
    if code == LOGISTIC:
        values = np.unique(y)
        if set(values.tolist()) <= {-1.0, 1.0}:
            return y
        if set(values.tolist()) <= {0.0, 1.0}:
            return 2.0 * y - 1.0
        raise ValueError(
            f"logistic labels must be {{-1, +1}} or {{0, 1}}, got values {values[:6].tolist()}"
            f"{' ...' if values.size > 6 else ''}; map the classes to one of these"
        )
    if code == POISSON and y.size and y.min() < 0:
        raise ValueError(f"Poisson labels must be non-negative counts, got min(y)={y.min():g} "
                         f"at index {int(np.argmin(y))}")
    return y


def label_constant(code: int, y: np.ndarray) -> np.ndarray:
    """Return per-sample constants that make the loss zero at a perfect fit (Poisson: y log y - y)."""
    if code != POISSON:
        return np.zeros(0)
    # Half Poisson deviance minus what depends on z: adding it makes the reported
    # loss scikit-learn's half deviance (>= 0) without changing any gradient.
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(y > 0, y * np.log(np.where(y > 0, y, 1.0)), 0.0) - y


def initial_intercept(code: int, y: np.ndarray) -> float:
    """Return the optimal intercept of the model with zero weights (where training starts)."""
    mean = float(np.mean(y)) if y.size else 0.0
    if code == LEAST_SQUARES:
        return mean
    if code == LOGISTIC:
        p = min(max((mean + 1.0) / 2.0, 1e-12), 1.0 - 1e-12)  # y is +-1 here
        return float(np.log(p / (1.0 - p)))
    return float(np.log(max(mean, 1e-12)))


def pointwise(xp: Any, code: int, z: Any, y: Any, const: Any = None) -> tuple[Any, Any]:
    """Return (loss, residual dl/dz) elementwise; the array-module reference of the kernels."""
    if code == LEAST_SQUARES:
        r = z - y
        return 0.5 * r * r, r
    if code == LOGISTIC:
        u = -y * z
        e = xp.exp(-xp.abs(u))
        loss = xp.maximum(u, 0) + xp.log1p(e)
        sig = xp.where(u >= 0, 1 / (1 + e), e / (1 + e))  # sigmoid(u), stable both ways
        return loss, -y * sig
    e = xp.exp(z)
    loss = e - y * z
    if const is not None and const.size:
        loss = loss + const
    return loss, e - y
