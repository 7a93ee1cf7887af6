"""GLM solvers on several ranks against the float64 reference — tier 2 (mpiexec, CPU).

Run by tests/glm/test_mpi.py as ``mpiexec -n {1,2,4} python -m pytest`` on this
file; every rank runs the same tests in the same order and holds the full data
(generated from a seed), so each rank checks against the same single-process
reference. Tolerance: FP64 CA-SGD and SGD iterates equal the reference SGD
iterates on the same batches to 1e-10 relative (casgd.md claims 1 and 2).
"""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import pytest

import commwire as cw
from commwire import glm
from _reference import LOSSES, make_data, rel, sgd, words

COMM = cw.init()
B, H, LR, L2 = 8, 75, 0.05, 0.01  # H is no multiple of s > 1: the short final group is covered


def _full(result: glm.FitResult, blocks: glm.ColumnBlocks) -> np.ndarray:
    parts = COMM.allgather_object((blocks.start, result.coef))
    return np.concatenate([c for _, c in sorted(parts, key=lambda p: p[0])])


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("s", [1, 2, 4, 8, 16])
def test_casgd_iterates_equal_sgd(loss: str, s: int) -> None:
    X, y = make_data(loss)
    w_ref, c_ref = sgd(X, y, loss, glm.batch_indices(len(y), B, H, seed=3), LR, L2)
    blocks = glm.from_array(X, y, comm=COMM)
    result = glm.solve(blocks, loss=loss, solver="casgd", s=s, batch_size=B, lr=LR, l2=L2,
                       max_steps=H, tol=None, seed=3, comm=COMM)
    assert rel(_full(result, blocks), w_ref) < 1e-10
    assert abs(result.intercept - c_ref) < 1e-10 * max(1.0, abs(c_ref))
    assert result.n_exchanges == math.ceil(H / s)


@pytest.mark.parametrize("loss", LOSSES)
def test_sgd_solver_equals_reference(loss: str) -> None:
    X, y = make_data(loss, seed=1)
    w_ref, c_ref = sgd(X, y, loss, glm.batch_indices(len(y), B, H, seed=5), LR, 0.0, fit_intercept=False)
    blocks = glm.from_array(X, y, comm=COMM)
    result = glm.solve(blocks, loss=loss, solver="sgd", batch_size=B, lr=LR, max_steps=H, tol=None,
                       seed=5, fit_intercept=False, comm=COMM)
    assert rel(_full(result, blocks), w_ref) < 1e-10
    assert result.intercept == 0.0


@pytest.mark.parametrize("s, precision, itemsize", [(1, "fp64", 8), (4, "fp64", 8), (16, "mixed", 4)])
def test_allreduce_count_and_bytes(s: int, precision: str, itemsize: int) -> None:
    X, y = make_data("logistic")
    blocks = glm.from_array(X, y, comm=COMM)
    before = cw.stats()["allreduce"] if "allreduce" in cw.stats() else {"calls": 0, "bytes": 0}
    glm.solve(blocks, loss="logistic", s=s, batch_size=B, lr=LR, precision=precision, max_steps=H,
              tol=None, comm=COMM)
    after = cw.stats()["allreduce"]
    full, last = divmod(H, s)
    expected = (full * words(s, B) + words(last, B)) * itemsize
    assert after["calls"] - before["calls"] == math.ceil(H / s)
    assert after["bytes"] - before["bytes"] == expected


def test_xp_kernels_match_numba() -> None:
    X, y = make_data("poisson")
    blocks = glm.from_array(X, y, comm=COMM)
    runs = [glm.solve(blocks, loss="poisson", s=4, batch_size=B, lr=LR, l2=L2, max_steps=H, tol=None,
                      kernels=k, comm=COMM) for k in ("numba", "xp")]
    assert rel(runs[1].coef, runs[0].coef) < 1e-12


def test_blocks_with_different_row_counts_raise_everywhere() -> None:
    if COMM.size == 1:
        pytest.skip("needs two ranks")
    X, y = make_data("least_squares")
    keep = len(y) - (COMM.rank == 1)  # rank 1 drops its last row
    lo, hi = glm.column_ranges(X.shape[1], COMM.size)[COMM.rank]
    blocks = glm.ColumnBlocks(X=X[:keep, lo:hi], y=y[:keep], start=lo, n_features=X.shape[1])
    with pytest.raises(ValueError, match=r"different row counts \[256, 255"):
        glm.solve(blocks, loss="least_squares", batch_size=B, max_steps=4, comm=COMM)


def test_scatter_from_root_equals_every_rank() -> None:
    X, y = make_data("logistic")
    mine = glm.from_array(X, y, comm=COMM)
    sent = glm.from_array(X if COMM.rank == 0 else None, y if COMM.rank == 0 else None, comm=COMM, root=0)
    np.testing.assert_array_equal(sent.X, mine.X)
    np.testing.assert_array_equal(sent.y, y)
    assert (sent.start, sent.n_features) == (mine.start, mine.n_features)


def test_npy_and_svmlight_blocks_load_per_rank() -> None:
    from sklearn.datasets import dump_svmlight_file

    X, y = make_data("poisson")
    mine = glm.from_array(X, y, comm=COMM)
    folder = COMM.broadcast_object(tempfile.mkdtemp(prefix="cw-glm-") if COMM.rank == 0 else None)
    np.save(os.path.join(folder, f"X_{COMM.rank}.npy"), np.ascontiguousarray(mine.X))
    dump_svmlight_file(mine.X, y, os.path.join(folder, f"X_{COMM.rank}.svm"), zero_based=True)
    if COMM.rank == 0:
        np.save(os.path.join(folder, "y.npy"), y)
    COMM.barrier()
    npy = glm.load_npy(os.path.join(folder, "X_{rank}.npy"), os.path.join(folder, "y.npy"), comm=COMM)
    svm = glm.load_svmlight(os.path.join(folder, "X_{rank}.svm"), comm=COMM,
                            n_features=mine.X.shape[1], zero_based=True)
    assert isinstance(npy.X, np.memmap)
    for got in (npy, svm):
        np.testing.assert_allclose(got.X, mine.X, rtol=1e-15)
        np.testing.assert_allclose(got.y, y)
        assert (got.start, got.n_features) == (mine.start, mine.n_features)


def test_estimator_coef_independent_of_ranks() -> None:
    X, y = make_data("logistic", seed=2)
    est = glm.GLM("logistic", s=4, batch_size=B, lr=LR, l2=L2, max_iter=3, tol=None, random_state=7)
    est.fit(X, y, comm=COMM)
    steps = 3 * (len(y) // B)
    w_ref, c_ref = sgd(X, y, "logistic", glm.batch_indices(len(y), B, steps, seed=7), LR, L2)
    assert est.coef_.shape == (1, X.shape[1])
    assert rel(est.coef_[0], w_ref) < 1e-10
    assert abs(est.intercept_[0] - c_ref) < 1e-10
    assert est.score(X, y) > 0.8
