"""GLM input validation: every bad input raises ValueError naming the value and the fix — tier 1 (single process)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import commwire as cw
from commwire import glm
from commwire.glm import GLM, _estimator

COMM = cw.init()


def _data(m: int = 512, n: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((m, n))
    return X, (X @ rng.standard_normal(n) > 0).astype(float)


def _fit(X, y, loss: str = "logistic", **kw) -> GLM:
    return GLM(loss, batch_size=16, s=4, max_iter=2, random_state=0, **kw).fit(X, y)


@pytest.mark.parametrize("make", [sp.csr_matrix, sp.csc_matrix, sp.coo_matrix, sp.csr_array])
def test_sparse_x_is_densified_and_fits_like_dense(make) -> None:
    X, y = _data()
    X[np.abs(X) < 0.8] = 0.0
    dense, sparse = _fit(X, y), _fit(make(X), y)
    np.testing.assert_array_equal(dense.coef_, sparse.coef_)
    np.testing.assert_array_equal(dense.predict(X), sparse.predict(sp.csr_matrix(X)))
    assert sparse.score(sp.csr_matrix(X), y) == dense.score(X, y)


def test_sparse_x_over_the_dense_limit_says_how_big_and_what_to_do(monkeypatch) -> None:
    X, y = _data()
    monkeypatch.setattr(_estimator, "SPARSE_DENSE_BYTES", 1000)
    with pytest.raises(ValueError, match=r"scipy sparse matrix of shape \(512, 6\).*GiB.*SPARSE_DENSE_BYTES.*load_svmlight"):
        _fit(sp.csr_matrix(X), y)


@pytest.mark.parametrize("make_y, match", [
    (lambda y: y[:, None], r"y must be a 1-D array of labels, got shape \(512, 1\); pass y.ravel\(\)"),
    (lambda y: y[:-3], r"X has 512 rows but y has 509 labels"),
    (lambda y: sp.csr_matrix(y), r"y is a scipy sparse matrix of shape \(1, 512\); .*y.toarray\(\).ravel\(\)"),
    (lambda y: np.where(y > 0, "yes", "no"), r"y has dtype <U3; numeric labels are needed .*LabelEncoder"),
    (lambda y: y + 1, r"logistic labels must be \{-1, \+1\} or \{0, 1\}, got values \[1.0, 2.0\]; map the classes"),
    (lambda y: np.where(np.arange(len(y)) == 9, np.nan, y), r"y holds 1 NaN/Inf values \(first at index 9\); remove"),
])
def test_bad_labels_name_the_value_and_the_fix(make_y, match: str) -> None:
    X, y = _data()
    with pytest.raises(ValueError, match=match):
        _fit(X, make_y(y))


def test_labels_as_a_list_are_accepted() -> None:
    X, y = _data()
    np.testing.assert_array_equal(_fit(X, list(y)).coef_, _fit(X, y).coef_)
    est = _fit(X, y)
    assert est.objective(X, list(y)) == est.objective(X, y)


def test_negative_poisson_counts_name_the_value_and_the_fix() -> None:
    X, y = _data()
    counts = y.copy()
    counts[[4, 7]] = [-2.0, -0.5]
    with pytest.raises(ValueError, match=r"non-negative counts, got min\(y\)=-2 at index 4 \(2 negative values\); "
                                         r"use loss='least_squares'"):
        _fit(X, counts, "poisson")
    counts[4] = np.nan  # NaN is reported as NaN, not as the smallest count
    with pytest.raises(ValueError, match=r"min\(y\)=-0.5 at index 7"):
        _fit(X, counts, "poisson")


@pytest.mark.parametrize("make_x, match", [
    (lambda X: X[:, 0], r"X must be a 2-D array \(samples x features\), got shape \(512,\); .*X.reshape\(-1, 1\)"),
    (lambda X: X.astype(str), r"X has dtype <U\d+; GLM needs real numbers: convert with X.astype\(float\)"),
    (lambda X: X.astype(object), r"X has dtype object; GLM needs real numbers"),
    (lambda X: X + 1j, r"X has dtype complex128; GLM needs real numbers"),
    (lambda X: X[:, :0], r"X has shape \(512, 0\): no features"),
])
def test_bad_features_name_the_value_and_the_fix(make_x, match: str) -> None:
    X, y = _data()
    with pytest.raises(ValueError, match=match):
        _fit(make_x(X), y)


@pytest.mark.parametrize("value, shown", [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "-inf")])
def test_non_finite_x_names_row_column_and_value(value: float, shown: str) -> None:
    X, y = _data()
    X[11, 4] = value
    with pytest.raises(ValueError, match=rf"X holds NaN/Inf: rank 0's block, row 11, column 4 \(value {shown}\); "
                                         r"remove or impute .*SimpleImputer"):
        _fit(X, y)
    blocks = glm.from_array(X, y, comm=COMM)
    with pytest.raises(ValueError, match=r"row 11, column 4"):
        glm.solve(blocks, loss="logistic", batch_size=16, max_steps=2, comm=COMM)


def test_empty_x_says_how_many_rows_are_needed() -> None:
    X, y = _data()
    with pytest.raises(ValueError, match=r"X has 0 rows; fitting needs at least s\*batch_size=4\*16=64 samples"):
        _fit(X[:0], y[:0])


@pytest.mark.parametrize("settings, match", [
    ({"tol": "1e-3"}, r"tol='1e-3' must be a non-negative number \(e.g. 1e-4\) or None"),
    ({"lr": True}, r"lr=True must be a positive finite number, e.g. lr=0.1"),
    ({"lr": "0.1"}, r"lr='0.1' must be a positive finite number"),
    ({"l2": -1.0}, r"l2=-1.0 must be a non-negative finite number"),
    ({"l2": np.nan}, r"l2=nan must be a non-negative finite number"),
])
def test_bad_settings_name_the_value(settings: dict, match: str) -> None:
    X, y = _data()
    with pytest.raises(ValueError, match=match):
        _fit(X, y, **settings)


def test_numpy_number_settings_are_accepted() -> None:
    config = glm.SolverConfig(lr=np.float32(0.5), l2=np.int64(0), tol=np.float64(1e-3), max_steps=np.int64(3))
    assert config.lr == 0.5
    with pytest.raises(ValueError, match=r"max_steps=True must be a positive integer"):
        glm.SolverConfig(max_steps=True)
    with pytest.raises(ValueError, match=r"max_steps='3' must be a positive integer"):
        glm.SolverConfig(max_steps="3")


@pytest.mark.parametrize("make_x, match", [
    (lambda X: X[0], r"got shape \(6,\); reshape a single sample with X.reshape\(1, -1\)"),
    (lambda X: X[:, :4], r"X has shape \(512, 4\); 6 features are expected"),
    (lambda X: sp.csr_matrix(X[:, :4]), r"X has shape \(512, 4\); 6 features are expected"),
    (lambda X: np.where(np.arange(6) == 2, np.nan, X), r"X holds NaN/Inf: row 0, column 2 \(value nan\)"),
])
def test_predict_rejects_bad_x(make_x, match: str) -> None:
    X, y = _data()
    est = _fit(X, y)
    with pytest.raises(ValueError, match=match):
        est.predict(make_x(X))


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_validation_on_ranks(ranks: int) -> None:
    from mpi_helpers import run_mpi_pytest

    run_mpi_pytest(ranks, "tests/glm/mpi_validation.py", timeout=240)
