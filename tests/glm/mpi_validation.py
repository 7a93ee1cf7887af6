"""GLM input validation on several ranks — tier 2 (run under mpiexec by test_validation.py).

Every rank holds the same X and y; each densifies only its own columns of a
sparse X, and a bad value in any rank's block makes every rank raise the same
error (nobody is left waiting in a collective).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import commwire as cw
from commwire import glm
from commwire.glm import GLM

COMM = cw.init()


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    X = rng.standard_normal((256, 7))
    X[np.abs(X) < 0.7] = 0.0
    return X, (X @ rng.standard_normal(7) > 0).astype(float)


def _fit(X, y) -> GLM:
    return GLM("logistic", batch_size=16, s=4, max_iter=2, random_state=0).fit(X, y, comm=COMM)


def test_sparse_fit_equals_dense_fit_and_densifies_only_this_ranks_columns(monkeypatch) -> None:
    X, y = _data()
    seen = []
    original = glm.ColumnBlocks.__post_init__
    monkeypatch.setattr(glm.ColumnBlocks, "__post_init__", lambda self: (seen.append(self.X.shape), original(self)))
    sparse = _fit(sp.csr_matrix(X), y)
    lo, hi = glm.column_ranges(7, COMM.size)[COMM.rank]
    assert seen[0] == (256, hi - lo)
    np.testing.assert_allclose(sparse.coef_, _fit(X, y).coef_, rtol=0, atol=0)
    np.testing.assert_array_equal(sparse.predict(sp.csc_matrix(X)), sparse.predict(X))


@pytest.mark.parametrize("col", [0, 6])
def test_a_nan_in_any_block_raises_the_same_error_on_every_rank(col: int) -> None:
    X, y = _data()
    X[9, col] = np.nan
    with pytest.raises(ValueError) as info:
        _fit(X, y)
    messages = COMM.allgather_object(str(info.value))
    assert len(set(messages)) == 1 and f"row 9, column {col}" in messages[0], messages
