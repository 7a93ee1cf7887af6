"""GLM estimator: scikit-learn optima and conventions — tier 1 (single process).

The final objective (mean loss + l2/2 ||w||^2, Poisson as half deviance) must
be within 1% of the objective at scikit-learn's solution for the same
regularisation: LogisticRegression(C) <-> l2 = 1/(C m), Ridge(alpha) <->
l2 = alpha/m, PoissonRegressor(alpha) <-> l2 = alpha.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from sklearn.base import clone, is_classifier, is_regressor
from sklearn.datasets import load_breast_cancer, load_diabetes
from sklearn.linear_model import LogisticRegression, PoissonRegressor, Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

import commwire as cw
from commwire import glm
from commwire.glm import GLM
from _reference import make_data

COMM = cw.init()


def _objective(X, y, coef, intercept, loss, l2) -> float:
    blocks = glm.from_array(X, y, comm=COMM)
    return glm.objective(blocks, np.ravel(coef), float(np.ravel(intercept)[0]), loss=loss, l2=l2, comm=COMM)


def _poisson_set() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((2000, 10))
    return X, rng.poisson(np.exp(X @ (0.2 * rng.standard_normal(10)) + 0.5)).astype(float)


def _cases():
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    yield ("logistic", X, y, 1 / len(y), LogisticRegression(C=1.0, tol=1e-10, max_iter=10_000),
           dict(batch_size=128, lr=0.5, max_iter=300))
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    yield ("least_squares", X, y, 1.0 / len(y), Ridge(alpha=1.0), dict(batch_size=100, lr=0.1, max_iter=300))
    X, y = _poisson_set()
    yield ("poisson", X, y, 1e-3, PoissonRegressor(alpha=1e-3, tol=1e-10, max_iter=10_000),
           dict(batch_size=128, lr=0.05, max_iter=200))


@pytest.mark.parametrize("case", list(_cases()), ids=["breast_cancer", "diabetes", "poisson"])
@pytest.mark.parametrize("precision", ["fp64", "mixed"])
def test_final_loss_within_one_percent_of_sklearn(case, precision: str) -> None:
    loss, X, y, l2, reference, settings = case
    reference.fit(X, y)
    optimum = _objective(X, y, reference.coef_, reference.intercept_, loss, l2)
    est = GLM(loss, s=4, l2=l2, tol=None, random_state=0, precision=precision, **settings).fit(X, y)
    assert est.objective(X, y) <= 1.01 * optimum


def test_params_clone_and_pipeline() -> None:
    X, y = make_data("logistic", m=512)
    est = GLM("logistic", s=4, batch_size=16, lr=0.1, max_iter=5, random_state=0)
    assert est.get_params()["s"] == 4
    assert est.set_params(s=2, precision="mixed") is est and est.s == 2
    twin = clone(est)
    assert twin.get_params() == est.get_params() and not hasattr(twin, "coef_")
    pipe = make_pipeline(StandardScaler(), est).fit(X, y)
    assert pipe.score(X, y) > 0.8
    proba = pipe.predict_proba(X)
    assert proba.shape == (512, 2) and np.allclose(proba.sum(axis=1), 1.0)
    np.testing.assert_array_equal(pipe.predict(X), pipe.classes_[(proba[:, 1] > 0.5).astype(int)])
    assert is_classifier(est) and is_regressor(GLM("poisson"))


def test_fitted_attributes_follow_sklearn_shapes() -> None:
    X, y = make_data("logistic")
    clf = GLM("logistic", batch_size=16, max_iter=3, random_state=0).fit(X, 2 * y - 1)
    assert clf.coef_.shape == (1, X.shape[1]) and clf.intercept_.shape == (1,)
    assert set(np.unique(clf.predict(X))) <= {-1.0, 1.0}
    assert len(clf.loss_curve_) == clf.n_iter_ == 3 and clf.t_ == 3 * (len(y) // 16)
    X, y = make_data("least_squares")
    reg = GLM("least_squares", batch_size=16, max_iter=3, random_state=None).fit(X, y)
    assert reg.coef_.shape == (X.shape[1],) and isinstance(reg.intercept_, float)
    assert not hasattr(reg, "predict_proba")
    np.testing.assert_allclose(reg.predict(X), X @ reg.coef_ + reg.intercept_, rtol=1e-12)
    again = pickle.loads(pickle.dumps(reg))
    np.testing.assert_array_equal(again.predict(X), reg.predict(X))
    assert reg.score(X, y) > 0.5


def test_fit_accepts_column_blocks() -> None:
    X, y = make_data("poisson")
    blocks = glm.from_array(X, y, comm=COMM)
    a = GLM("poisson", batch_size=16, max_iter=2, random_state=3).fit(blocks)
    b = GLM("poisson", batch_size=16, max_iter=2, random_state=3).fit(X, y)
    np.testing.assert_array_equal(a.coef_, b.coef_)
    np.testing.assert_allclose(a.predict(blocks), np.exp(X @ a.coef_ + a.intercept_), rtol=1e-12)


def test_fit_errors_name_the_value() -> None:
    X, y = make_data("logistic")
    with pytest.raises(ValueError, match=r"single class 1.0"):
        GLM("logistic").fit(X, np.ones(len(y)))
    with pytest.raises(ValueError, match=r"random_state='seed' must be"):
        GLM("logistic", random_state="seed").fit(X, y)
    est = GLM("logistic", batch_size=16, max_iter=1).fit(X, y)
    with pytest.raises(ValueError, match=r"24 features are expected"):
        est.predict(X[:, :5])
