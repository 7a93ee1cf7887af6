"""GLM: a scikit-learn estimator over the distributed SGD / CA-SGD solvers."""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import check_is_fitted

from . import _losses
from .data import ColumnBlocks, from_array
from .solver import SolverConfig, margins, objective, solve

__all__ = ["GLM"]


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
        s: inner steps per Gram exchange (casgd).
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

    def __init__(self, loss: str = "logistic", *, solver: str = "casgd", s: int = 8, batch_size: int = 64,
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
            return ColumnBlocks(X=X.X, y=y, start=X.start, n_features=X.n_features)
        if y is None:
            raise ValueError("y is None; pass the labels, or a ColumnBlocks holding them")
        return from_array(X, y, comm=comm)

    def fit(self, X: Any, y: Any = None, *, comm: Any = None) -> GLM:
        """Fit on the full X/y (every rank) or on this rank's ColumnBlocks; return self."""
        if comm is None:
            import commwire as cw

            comm = cw.init()
        blocks = self._blocks(X, y, comm)
        code = _losses.loss_code(self.loss)
        labels = np.asarray(blocks.y.get() if hasattr(blocks.y, "get") else blocks.y)
        if code == _losses.LOGISTIC:
            _losses.check_labels(code, labels)
            self.classes_ = np.unique(labels)
            if self.classes_.size == 1:
                raise ValueError(f"y holds the single class {self.classes_[0].item()!r}; logistic regression needs two")
        config = SolverConfig(loss=self.loss, solver=self.solver, s=self.s, batch_size=self.batch_size,
                              lr=self.lr, l2=self.l2, precision=self.precision, max_iter=self.max_iter,
                              tol=self.tol, n_iter_no_change=self.n_iter_no_change,
                              fit_intercept=self.fit_intercept, seed=self._seed(comm))
        result = solve(blocks, config, comm=comm)
        slices = comm.allgather_object((blocks.start, result.coef))
        coef = np.concatenate([c for _, c in sorted(slices, key=lambda item: item[0])])
        self._comm = comm
        self.result_ = result
        self.loss_curve_ = list(result.loss_curve)
        self.n_iter_ = result.n_iter
        self.t_ = result.n_steps
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
        comm = getattr(self, "_comm", None)
        if comm is None:
            import commwire as cw

            comm = self._comm = cw.init()
        return comm

    def _local(self, X: Any) -> tuple[ColumnBlocks, np.ndarray]:
        check_is_fitted(self)
        comm = self._communicator()
        if not isinstance(X, ColumnBlocks):
            X = np.asarray(X)
            if X.ndim != 2 or X.shape[1] != self.n_features_in_:
                raise ValueError(f"X has shape {X.shape}; {self.n_features_in_} features are expected")
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
        blocks = ColumnBlocks(X=blocks.X, y=y, start=blocks.start, n_features=blocks.n_features)
        return objective(blocks, coef, float(np.ravel(self.intercept_)[0]), loss=self.loss, l2=self.l2,
                         comm=self._communicator())
