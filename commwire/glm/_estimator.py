"""GLM: a scikit-learn estimator over the distributed SGD / CA-SGD solvers."""

from __future__ import annotations

import secrets
import sys
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import check_is_fitted

from ..comm.runtime import default_comm
from . import _losses
from .data import ColumnBlocks, column_ranges, from_array
from .solver import SolverConfig, check_targets, margins, objective, solve

__all__ = ["GLM"]

SPARSE_DENSE_BYTES = 1 << 30
"""Largest dense column block (bytes of float64, per rank) a scipy sparse X is densified to.

The solvers work on dense column blocks, so a sparse X is converted block by
block (each rank densifies only its own columns); above this size fit and
predict raise instead of allocating it."""


def _is_sparse(x: Any) -> bool:
    # A scipy sparse input means scipy is already imported: no import here otherwise.
    sparse = sys.modules.get("scipy.sparse")
    return sparse is not None and sparse.issparse(x)


def _labels(y: Any) -> np.ndarray:
    """Return y as a 1-D numpy array, or raise naming its shape and the fix."""
    if _is_sparse(y):
        raise ValueError(f"y is a scipy sparse matrix of shape {y.shape}; pass a dense 1-D array, "
                         f"e.g. y.toarray().ravel()")
    y = np.asarray(y.get() if hasattr(y, "get") else y)
    if y.ndim != 1:
        hint = "; pass y.ravel() for a column vector" if y.ndim == 2 and 1 in y.shape else ""
        raise ValueError(f"y must be a 1-D array of labels, got shape {y.shape}{hint}")
    return y


def _sparse_block(X: Any, comm: Any) -> ColumnBlocks:
    """Return this rank's columns of a scipy sparse X as a dense block (labels to be set by the caller)."""
    m, n = X.shape
    widest = m * -(-n // comm.size) * 8  # the same on every rank: all raise or none
    if widest > SPARSE_DENSE_BYTES:
        raise ValueError(
            f"X is a scipy sparse matrix of shape {X.shape}; GLM densifies each rank's column block, and "
            f"{m} rows x {-(-n // comm.size)} columns take {widest / 2**30:.3g} GiB, over the "
            f"{SPARSE_DENSE_BYTES / 2**30:g} GiB limit (commwire.glm._estimator.SPARSE_DENSE_BYTES); use more ranks, "
            f"fewer features, or per-rank files (commwire.glm.load_svmlight with '{{rank}}' in the path)"
        )
    lo, hi = column_ranges(n, comm.size)[comm.rank]
    return ColumnBlocks(X=X.tocsc()[:, lo:hi].toarray(), y=np.zeros(m), start=lo, n_features=int(n))


def _features(X: Any, n_features: int | None = None) -> Any:
    """Validate a dense X (samples x features) held by every rank; return it as an array."""
    if not hasattr(X, "__cuda_array_interface__"):
        X = np.asarray(X)
    if getattr(X, "ndim", None) != 2:
        shape = getattr(X, "shape", None)
        hint = ("; reshape a single sample with X.reshape(1, -1)" if n_features is not None
                else "; reshape a single feature with X.reshape(-1, 1)")
        raise ValueError(f"X must be a 2-D array (samples x features), got shape {shape}{hint if shape else ''}")
    if np.dtype(X.dtype).kind not in "biuf":
        raise ValueError(f"X has dtype {X.dtype}; GLM needs real numbers: convert with X.astype(float) or encode "
                         f"categorical columns (e.g. sklearn.preprocessing.OneHotEncoder)")
    if n_features is not None and X.shape[1] != n_features:
        raise ValueError(f"X has shape {X.shape}; {n_features} features are expected, as in fit")
    if n_features is None and X.shape[1] == 0:
        raise ValueError(f"X has shape {X.shape}: no features; GLM needs at least one column")
    return X


def _is_logistic(est: GLM) -> bool:
    return _losses.loss_code(est.loss) == _losses.LOGISTIC


class GLM(BaseEstimator):
    """Fit a logistic, least-squares or Poisson GLM with SGD or communication-avoiding SGD.

    Every rank of the communicator calls fit with the same arguments: either the
    full X and y (each rank keeps its column block) or its own ColumnBlocks
    (from commwire.glm.from_array(root=...), load_npy or load_svmlight). The
    fitted coef_ is the full weight vector on every rank.

    Args:
        loss: "logistic" (labels {-1,+1} or {0,1}), "least_squares" or "poisson".
        solver: "sgd" (one allreduce of b margins per step) or "casgd" (one per s steps).
        s: inner steps per Gram exchange (casgd), or "auto": chosen at fit time from all-reduces and
            Gram products timed on the communicator, with the cost model of :mod:`commwire.costmodel`
            (every rank uses the same s; the fitted ``s_`` says which, ``result_.auto`` how).
        batch_size: rows per step.
        lr: constant step size.
        l2: L2 coefficient; the objective is mean loss + l2/2 ||coef||^2.
        precision: "fp64", "fp32", "mixed" (BF16 storage, FP32 elsewhere), a dict of slots or a Precision.
        max_iter: epochs.
        tol: stop when the epoch loss improves by less than tol for n_iter_no_change epochs (None: never).
        n_iter_no_change: see tol.
        fit_intercept: learn an unpenalised intercept.
        random_state: seed of the batch order (None: drawn on rank 0 and shared).

    Example:
        >>> from sklearn.pipeline import make_pipeline
        >>> from sklearn.preprocessing import StandardScaler
        >>> model = make_pipeline(StandardScaler(), GLM(loss="logistic", s=8, precision="mixed"))
        >>> model.fit(X, y).score(X, y)
    """

    def __init__(self, loss: str = "logistic", *, solver: str = "casgd", s: int | str = 8, batch_size: int = 64,
                 lr: float = 0.1, l2: float = 0.0, precision: Any = "fp64", max_iter: int = 100,
                 tol: float | None = 1e-4, n_iter_no_change: int = 5, fit_intercept: bool = True,
                 random_state: Any = None) -> None:
        self.loss = loss
        self.solver = solver
        self.s = s
        self.batch_size = batch_size
        self.lr = lr
        self.l2 = l2
        self.precision = precision
        self.max_iter = max_iter
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.fit_intercept = fit_intercept
        self.random_state = random_state

    def __sklearn_tags__(self) -> Any:
        from sklearn.utils import ClassifierTags, RegressorTags

        tags = super().__sklearn_tags__()
        if _is_logistic(self):
            tags.estimator_type, tags.classifier_tags, tags.regressor_tags = "classifier", ClassifierTags(), None
        else:
            tags.estimator_type, tags.classifier_tags, tags.regressor_tags = "regressor", None, RegressorTags()
        return tags

    # ------------------------------------------------------------------ fit
    def _seed(self, comm: Any) -> int:
        rs = self.random_state
        if isinstance(rs, (int, np.integer)) and not isinstance(rs, bool):
            return int(rs)
        if rs is None:
            draw = secrets.randbits(63) if comm.rank == 0 else None
        elif isinstance(rs, np.random.RandomState):
            draw = int(rs.randint(2**31 - 1)) if comm.rank == 0 else None
        elif isinstance(rs, np.random.Generator):
            draw = int(rs.integers(2**63 - 1)) if comm.rank == 0 else None
        else:
            raise ValueError(f"random_state={rs!r} must be None, an int, a RandomState or a Generator")
        # Every rank must draw the same batches: rank 0's seed is the shared one.
        return int(comm.broadcast_object(draw, root=0))

    def _blocks(self, X: Any, y: Any, comm: Any) -> ColumnBlocks:
        if isinstance(X, ColumnBlocks):
            if y is None:
                return X
            return ColumnBlocks(X=X.X, y=_labels(y), start=X.start, n_features=X.n_features)
        if y is None:
            raise ValueError("y is None; pass the labels, or a ColumnBlocks holding them")
        y = _labels(y)
        if _is_sparse(X):
            block = _sparse_block(X, comm)
            return ColumnBlocks(X=block.X, y=y, start=block.start, n_features=block.n_features)
        return from_array(_features(X), y, comm=comm)

    def fit(self, X: Any, y: Any = None, *, comm: Any = None, coef_init: Any = None,
            intercept_init: Any = None) -> GLM:
        """Fit on the full X/y (every rank) or on this rank's ColumnBlocks; return self.

        X may be a scipy sparse matrix: each rank densifies its own column block, up to
        ``SPARSE_DENSE_BYTES`` (1 GiB) per rank, and raises above that. ``coef_init`` (all
        ``n_features`` weights, as ``coef_``) and ``intercept_init`` start the fit from a
        previous solution, as scikit-learn's SGD estimators take them (an elastic run goes
        on from its last commit this way, whatever the number of ranks).
        """
        comm = default_comm(comm, init_if_needed=True)
        blocks = self._blocks(X, y, comm)
        code = _losses.loss_code(self.loss)
        labels = np.asarray(blocks.y.get() if hasattr(blocks.y, "get") else blocks.y)
        if code == _losses.LOGISTIC:
            check_targets(code, labels)
            self.classes_ = np.unique(labels)
            if self.classes_.size == 1:
                raise ValueError(f"y holds the single class {self.classes_[0].item()!r}; logistic regression needs two")
        config = SolverConfig(loss=self.loss, solver=self.solver, s=self.s, batch_size=self.batch_size,
                              lr=self.lr, l2=self.l2, precision=self.precision, max_iter=self.max_iter,
                              tol=self.tol, n_iter_no_change=self.n_iter_no_change,
                              fit_intercept=self.fit_intercept, seed=self._seed(comm))
        local_init = None
        if coef_init is not None:
            full = np.asarray(coef_init, dtype=np.float64).ravel()
            if full.shape != (blocks.n_features,):
                raise ValueError(f"coef_init has {full.size} weights; give one per feature ({blocks.n_features}), "
                                 "e.g. a fitted model's coef_")
            local_init = full[blocks.start:blocks.start + int(blocks.X.shape[1])]
        icpt = None if intercept_init is None else float(np.ravel(intercept_init)[0])
        result = solve(blocks, config, comm=comm, coef_init=local_init, intercept_init=icpt)
        slices = comm.allgather_object((blocks.start, result.coef))
        coef = np.concatenate([c for _, c in sorted(slices, key=lambda item: item[0])])
        self._comm = comm
        self.result_ = result
        self.loss_curve_ = list(result.loss_curve)
        self.n_iter_ = result.n_iter
        self.t_ = result.n_steps
        self.s_ = result.s
        self.n_features_in_ = blocks.n_features
        if code == _losses.LOGISTIC:
            self.coef_, self.intercept_ = coef[None, :], np.array([result.intercept])
        else:
            self.coef_, self.intercept_ = coef, float(result.intercept)
        return self

    # -------------------------------------------------------------- predict
    def __getstate__(self) -> dict[str, Any]:
        # A communicator does not pickle; an unpickled model predicts on the world.
        state = dict(super().__getstate__())
        state.pop("_comm", None)
        return state

    def _communicator(self) -> Any:
        comm = self._comm = default_comm(getattr(self, "_comm", None), init_if_needed=True)
        return comm

    def _local(self, X: Any) -> tuple[ColumnBlocks, np.ndarray]:
        check_is_fitted(self)
        comm = self._communicator()
        if _is_sparse(X):
            if X.shape[1] != self.n_features_in_:
                raise ValueError(f"X has shape {X.shape}; {self.n_features_in_} features are expected, as in fit")
            X = _sparse_block(X, comm)
        elif not isinstance(X, ColumnBlocks):
            X = _features(X, self.n_features_in_)
            bad = ~np.isfinite(X)
            if bad.any():  # every rank holds the same X: every rank raises alike
                row, col = np.unravel_index(int(np.argmax(bad)), bad.shape)
                raise ValueError(f"X holds NaN/Inf: row {row}, column {col} (value {float(X[row, col])!r}); remove or "
                                 f"impute non-finite values first (sklearn.impute.SimpleImputer)")
            X = from_array(X, np.zeros(X.shape[0]), comm=comm)
        coef = np.ravel(self.coef_)[X.start:X.start + X.X.shape[1]]
        return X, coef

    def decision_function(self, X: Any) -> np.ndarray:
        """Return the linear predictor X coef + intercept (every rank)."""
        blocks, coef = self._local(X)
        z, _ = margins(blocks, coef, float(np.ravel(self.intercept_)[0]), comm=self._communicator())
        return z

    def predict(self, X: Any) -> np.ndarray:
        """Return class labels (logistic) or the predicted mean (least squares: z, Poisson: exp z)."""
        z = self.decision_function(X)
        code = _losses.loss_code(self.loss)
        if code == _losses.LOGISTIC:
            return self.classes_[(z > 0).astype(int)]
        return np.exp(z) if code == _losses.POISSON else z

    @available_if(_is_logistic)
    def predict_proba(self, X: Any) -> np.ndarray:
        """Return [P(classes_[0]), P(classes_[1])] per row (logistic only)."""
        z = self.decision_function(X)
        p = np.exp(-np.logaddexp(0.0, -z))  # sigmoid without overflow
        return np.column_stack([1.0 - p, p])

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """Return accuracy (logistic), R^2 (least squares) or D^2 explained Poisson deviance."""
        from sklearn.metrics import accuracy_score, d2_tweedie_score, r2_score

        code = _losses.loss_code(self.loss)
        pred = self.predict(X)
        if code == _losses.LOGISTIC:
            return float(accuracy_score(y, pred, sample_weight=sample_weight))
        if code == _losses.POISSON:
            return float(d2_tweedie_score(y, pred, sample_weight=sample_weight, power=1))
        return float(r2_score(y, pred, sample_weight=sample_weight))

    def objective(self, X: Any, y: Any) -> float:
        """Return the training objective mean loss + l2/2 ||coef||^2 at the fitted weights."""
        blocks, coef = self._local(X)
        blocks = ColumnBlocks(X=blocks.X, y=_labels(y), start=blocks.start, n_features=blocks.n_features)
        return objective(blocks, coef, float(np.ravel(self.intercept_)[0]), loss=self.loss, l2=self.l2,
                         comm=self._communicator())
