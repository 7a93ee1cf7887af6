"""SStepGram: payload layout, Gram blocks, prefix groups and counters — tier 1 (single process).

Multi-rank sums of the same payload are covered by mpi_glm.py through the solvers.
"""

from __future__ import annotations

import numpy as np
import pytest

import commwire as cw
from commwire.schedules import SStepGram
from _reference import words


@pytest.mark.parametrize("s, b", [(1, 5), (3, 4), (6, 2), (9, 3)])
def test_chunks_hold_margins_and_strictly_block_lower_gram(s: int, b: int) -> None:
    rng = np.random.default_rng(s * b)
    Y, w = rng.standard_normal((s * b, 7)), rng.standard_normal(7)
    ex = SStepGram(s=s, b=b, n_local=7, dtype="float64", comm=cw.init())
    ex.rows[:] = Y
    ex.weights[:] = w
    payload = ex.exchange()
    assert payload.size == SStepGram.words(s, b) == words(s, b)
    G = Y @ Y.T
    for j in range(s):
        # entries are O(1) sums of 7 products; atol covers the rounding of entries that cancel to ~0
        np.testing.assert_allclose(ex.margins(payload, j), Y[j * b:(j + 1) * b] @ w, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(ex.gram_row(payload, j), G[j * b:(j + 1) * b, :j * b], rtol=1e-13, atol=1e-13)


def test_short_group_sends_a_prefix_and_counts_bytes() -> None:
    comm = cw.init()
    ex = SStepGram(s=4, b=3, n_local=5, dtype="float64", comm_dtype="float32", comm=comm)
    ex.rows[:] = np.arange(60.0).reshape(12, 5) / 60
    before = cw.stats().get("allreduce", {"calls": 0, "bytes": 0})
    payload = ex.exchange(2)
    after = cw.stats()["allreduce"]
    assert payload.dtype == np.float32 and payload.size == words(2, 3)
    assert (after["calls"] - before["calls"], after["bytes"] - before["bytes"]) == (1, words(2, 3) * 4)
    assert ex.nbytes(2) == words(2, 3) * 4


@pytest.mark.parametrize("kwargs, match", [
    ({"s": 0, "b": 2, "n_local": 1}, r"s=0 must be a positive integer"),
    ({"s": 2, "b": 2, "n_local": 1, "dtype": "float16"}, r"dtype=float16 is not supported"),
    ({"s": 2, "b": 2, "n_local": 1, "xp": "jax"}, r"xp='jax' is not supported"),
])
def test_bad_arguments_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SStepGram(comm=cw.init(), **kwargs)
