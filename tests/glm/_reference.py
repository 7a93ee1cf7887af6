"""Independent float64 reference for the GLM tests: plain mini-batch SGD and data sets."""

from __future__ import annotations

import numpy as np

LOSSES = ("least_squares", "logistic", "poisson")


def make_data(loss: str, m: int = 256, n: int = 24, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Return a small well-conditioned (X, y) for the loss."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((m, n))
    w = rng.standard_normal(n) / np.sqrt(n)
    z = X @ w
    if loss == "least_squares":
        return X, z + 0.1 * rng.standard_normal(m) + 0.5
    if loss == "logistic":
        return X, np.where(z + 0.3 * rng.standard_normal(m) > 0, 1.0, 0.0)
    return X, rng.poisson(np.exp(0.5 * z + 0.3)).astype(np.float64)


def residual(loss: str, z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Return dl/dz straight from the formulas in casgd.md (labels y as given, {0,1} for logistic)."""
    if loss == "least_squares":
        return z - y
    if loss == "logistic":
        s = 2.0 * y - 1.0
        return -s / (1.0 + np.exp(s * z))
    return np.exp(z) - y


def start_intercept(loss: str, y: np.ndarray) -> float:
    """Return the intercept-only optimum the solvers start from."""
    if loss == "least_squares":
        return float(y.mean())
    if loss == "logistic":
        return float(np.log(y.mean() / (1.0 - y.mean())))
    return float(np.log(y.mean()))


def sgd(X: np.ndarray, y: np.ndarray, loss: str, batches: np.ndarray, lr: float, l2: float,
        fit_intercept: bool = True) -> tuple[np.ndarray, float]:
    """Run mini-batch SGD over the given batches; return (w, intercept)."""
    w = np.zeros(X.shape[1])
    c = start_intercept(loss, y) if fit_intercept else 0.0
    b = batches.shape[1]
    for B in batches:
        r = residual(loss, X[B] @ w + c, y[B])
        w = (1.0 - lr * l2) * w - lr / b * (X[B].T @ r)
        if fit_intercept:
            c -= lr / b * r.sum()
    return w, c


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """Return ||a - b|| / ||b||."""
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))


def words(s: int, b: int) -> int:
    """Return casgd.md's words per outer iteration: s(s-1)/2 b^2 + s b."""
    return s * (s - 1) // 2 * b * b + s * b
