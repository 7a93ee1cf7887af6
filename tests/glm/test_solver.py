"""SGD / CA-SGD solvers in one process: equivalence, precision, stopping, bad input — tier 1.

Equivalence tolerance: FP64 iterates equal the reference SGD's to 1e-10 relative
(casgd.md claim 1); the multi-rank versions are in mpi_glm.py. Mixed precision
must end within 0.5% of FP32 SGD's objective (claim 5).
"""

from __future__ import annotations

import numpy as np
import pytest

import commwire as cw
from commwire import glm
from _reference import LOSSES, make_data, rel, sgd

COMM = cw.init()
B, H, LR, L2 = 8, 75, 0.05, 0.01


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("s", [1, 2, 4, 8, 16])
def test_xp_path_iterates_equal_sgd(loss: str, s: int) -> None:
    X, y = make_data(loss, seed=4)
    w_ref, c_ref = sgd(X, y, loss, glm.batch_indices(len(y), B, H, seed=9), LR, L2)
    result = glm.solve(glm.from_array(X, y, comm=COMM), loss=loss, s=s, batch_size=B, lr=LR, l2=L2,
                       max_steps=H, tol=None, seed=9, kernels="xp", comm=COMM)
    assert rel(result.coef, w_ref) < 1e-10
    assert abs(result.intercept - c_ref) < 1e-10 * max(1.0, abs(c_ref))


def _data(loss: str) -> tuple[np.ndarray, np.ndarray]:
    return make_data(loss, m=4096, n=32, seed=11)


@pytest.mark.parametrize("loss", LOSSES)
def test_mixed_casgd_within_half_percent_of_fp32_sgd(loss: str) -> None:
    X, y = _data(loss)
    blocks = glm.from_array(X, y, comm=COMM)
    common = dict(loss=loss, batch_size=32, lr=0.05, l2=1e-3, max_iter=4, tol=None, seed=1, comm=COMM)
    base = glm.solve(blocks, solver="sgd", precision="fp32", **common)
    mixed = glm.solve(blocks, solver="casgd", s=16, precision="mixed", **common)
    f_base = glm.objective(blocks, base.coef, base.intercept, loss=loss, l2=1e-3, comm=COMM)
    f_mixed = glm.objective(blocks, mixed.coef, mixed.intercept, loss=loss, l2=1e-3, comm=COMM)
    assert abs(f_mixed - f_base) <= 5e-3 * f_base


def test_fp32_recurrence_rounds_in_float32() -> None:
    X, y = _data("logistic")
    blocks = glm.from_array(X, y, comm=COMM)
    runs = {p: glm.solve(blocks, loss="logistic", s=8, batch_size=32, lr=0.05, max_iter=2, tol=None,
                         precision=p, comm=COMM) for p in ("fp64", "fp32")}
    gap = rel(runs["fp32"].coef, runs["fp64"].coef)
    assert 1e-9 < gap < 1e-4  # float32 rounding is visible, and small


def test_bf16_storage_on_a_memory_map(tmp_path) -> None:
    X, y = _data("least_squares")
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    blocks = glm.load_npy(str(tmp_path / "X.npy"), str(tmp_path / "y.npy"), comm=COMM)
    assert isinstance(blocks.X, np.memmap)
    mixed = glm.solve(blocks, loss="least_squares", s=8, batch_size=32, lr=0.05, max_iter=2, tol=None,
                      precision="mixed", comm=COMM)
    exact = glm.solve(blocks, loss="least_squares", s=8, batch_size=32, lr=0.05, max_iter=2, tol=None,
                      comm=COMM)
    assert 1e-6 < rel(mixed.coef, exact.coef) < 2e-2  # BF16 data: ~2^-8 perturbation, not more


def test_tol_stops_casgd_on_the_same_step_as_sgd() -> None:
    X, y = make_data("logistic")
    blocks = glm.from_array(X, y, comm=COMM)
    # tol=1 can never be met: the second epoch stops the run at step 2*32 = 64, inside a group of 5.
    common = dict(loss="logistic", batch_size=B, lr=LR, max_iter=10, tol=1.0, n_iter_no_change=1, comm=COMM)
    runs = [glm.solve(blocks, solver="sgd", **common), glm.solve(blocks, solver="casgd", s=5, **common)]
    assert [r.n_steps for r in runs] == [64, 64] and all(r.converged for r in runs)
    assert [r.n_iter for r in runs] == [2, 2]
    assert rel(runs[1].coef, runs[0].coef) < 1e-10
    assert runs[0].loss_curve == pytest.approx(runs[1].loss_curve, rel=1e-12)


def test_loss_curve_falls() -> None:
    X, y = _data("poisson")
    result = glm.solve(glm.from_array(X, y, comm=COMM), loss="poisson", batch_size=32, lr=0.05, max_iter=5,
                       tol=None, comm=COMM)
    assert len(result.loss_curve) == result.n_iter == 5
    assert result.loss_curve[-1] < result.loss_curve[0]


def test_batches_are_epoch_permutations() -> None:
    idx = glm.batch_indices(100, 8, 24, seed=0)  # 12 batches per epoch (96 rows), two epochs
    first, second = idx[:12].ravel(), idx[12:].ravel()
    assert len(set(first.tolist())) == 96 and len(set(second.tolist())) == 96
    assert first.max() < 100 and not np.array_equal(first, second)


def test_divergent_learning_rate_is_detected() -> None:
    X, y = make_data("least_squares")
    with pytest.raises(ValueError, match=r"lr=50 diverged: mean batch loss .* lower lr, e.g. lr=5"):
        glm.solve(glm.from_array(X, y, comm=COMM), loss="least_squares", s=4, batch_size=B, lr=50.0,
                  max_iter=50, comm=COMM)


def _bad(loss: str, X: np.ndarray, y: np.ndarray, **kw) -> None:
    glm.solve(glm.from_array(X, y, comm=COMM), loss=loss, batch_size=B, max_steps=4, comm=COMM, **kw)


def test_bad_labels_and_values_raise_naming_them() -> None:
    X, y = make_data("logistic")
    with pytest.raises(ValueError, match=r"logistic labels must be .* got values \[0.0, 2.0\]"):
        _bad("logistic", X, 2 * y)
    with pytest.raises(ValueError, match=r"non-negative counts, got min\(y\)=-3"):
        _bad("poisson", X, np.where(y > 0, 1.0, -3.0))
    Xn = X.copy()
    Xn[5, 3] = np.nan
    with pytest.raises(ValueError, match=r"NaN/Inf: rank 0's block, row 5"):
        _bad("logistic", Xn, y)
    yi = y.copy()
    yi[7] = np.inf
    with pytest.raises(ValueError, match=r"y holds 1 NaN/Inf values \(first at index 7\)"):
        _bad("least_squares", X, yi)
    with pytest.raises(ValueError, match=r"s\*batch_size=4\*100=400 exceeds the 256 rows"):
        glm.solve(glm.from_array(X, y, comm=COMM), loss="logistic", s=4, batch_size=100, comm=COMM)


@pytest.mark.parametrize("kw, match", [
    ({"solver": "adam"}, r"solver='adam' is not supported"),
    ({"loss": "hinge"}, r"loss='hinge' is not supported"),
    ({"s": 0}, r"s=0 must be a positive integer"),
    ({"lr": -1.0}, r"lr=-1.0 must be a positive finite number"),
    ({"lr": 1.0, "l2": 2.0}, r"lr\*l2=2 >= 1"),
    ({"kernels": "cuda"}, r"kernels='cuda' is not supported"),
    ({"seed": -1}, r"seed=-1 must be a non-negative integer"),
    ({"precision": "fp8"}, r"precision='fp8' is not a preset"),
])
def test_bad_settings_raise(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        glm.SolverConfig(**kw)


@pytest.mark.parametrize("slots", [
    # a wider wire than the recurrence (narrowed before the kernel), FP64 master weights
    dict(communication="float64", recurrence="float32"),
    # an FP32 wire cut from FP64 products, FP32 master weights apart from the FP64 panel
    dict(communication="float32", update="float32"),
])
def test_custom_recipes_round_where_configured(slots: dict) -> None:
    X, y = _data("poisson")
    blocks = glm.from_array(X, y, comm=COMM)
    common = dict(loss="poisson", s=8, batch_size=32, lr=0.05, max_iter=2, tol=None, comm=COMM)
    exact = glm.solve(blocks, **common)
    custom = glm.solve(blocks, precision=glm.Precision(**slots), **common)
    assert 1e-10 < rel(custom.coef, exact.coef) < 1e-4


@pytest.mark.parametrize("loss", LOSSES)
def test_xp_path_matches_numba_in_mixed_precision(loss: str) -> None:
    X, y = _data(loss)
    blocks = glm.from_array(X, y, comm=COMM)
    runs = [glm.solve(blocks, loss=loss, s=8, batch_size=32, lr=0.05, max_iter=1, tol=None, precision="mixed",
                      kernels=k, comm=COMM) for k in ("numba", "xp")]
    assert rel(runs[1].coef, runs[0].coef) < 1e-4  # FP32 sums in different orders, nothing more


def test_training_runs_with_this_ranks_share_of_blas_threads(monkeypatch) -> None:
    # One BLAS thread per core in every rank oversubscribes a node: the Gram GEMM of a
    # 4-rank CA-SGD fit on 2 cores took 9.5 s instead of 0.07 s.
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from commwire.codecs import set_threads
    from commwire.glm import solver

    seen = []
    run = solver._Engine.run

    def spy(self, *args, **kwargs):
        seen.append({i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"})
        return run(self, *args, **kwargs)

    monkeypatch.setattr(solver._Engine, "run", spy)
    X, y = make_data("logistic", m=200, n=8, seed=3)
    set_threads(1)
    try:
        glm.solve(glm.from_array(X, y, comm=COMM), loss="logistic", s=4, batch_size=8, lr=0.1, max_iter=1, tol=None)
    finally:
        set_threads(None)
    assert seen == [{1}]
