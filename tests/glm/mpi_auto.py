"""s="auto" on several ranks — tier 2 (run under mpiexec -n 2 and -n 4 by test_mpi.py).

Every rank must train with the same s whatever each one measured (times are
MAX-reduced and rank 0's choice is broadcast), the run must stay SGD on the
same batches (FP64 iterates to 1e-10), and a bad s must raise the same error on
every rank before any collective.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import commwire as cw
from commwire import costmodel, glm
from commwire.glm import GLM, _auto
from _reference import make_data, rel, sgd

COMM = cw.init()


def _full(result: glm.FitResult, blocks: glm.ColumnBlocks) -> np.ndarray:
    parts = COMM.allgather_object((blocks.start, result.coef))
    return np.concatenate([c for _, c in sorted(parts, key=lambda p: p[0])])


def test_every_rank_uses_the_same_s_and_the_iterates_stay_sgd() -> None:
    X, y = make_data("poisson", m=512)
    blocks = glm.from_array(X, y, comm=COMM)
    result = glm.solve(blocks, loss="poisson", s="auto", batch_size=8, lr=0.05, l2=0.01, max_steps=75, tol=None,
                       seed=2, comm=COMM)
    auto = result.auto
    seen = COMM.allgather_object(repr((result.s, auto.s, auto.compute_s, auto.allreduce_s, auto.step_s)))
    assert len(set(seen)) == 1, seen  # the same s, and the same (MAX-reduced) measurements everywhere (nan too)
    assert isinstance(auto.link, costmodel.LinkModel) and auto.link.beta > 0
    assert len(auto.allreduce_s) == len(auto.candidates) and auto.allreduces > 0
    assert result.n_exchanges == math.ceil(75 / result.s)
    w_ref, _ = sgd(X, y, "poisson", glm.batch_indices(512, 8, 75, seed=2), 0.05, 0.01)
    assert rel(_full(result, blocks), w_ref) < 1e-10


def test_ranks_that_measure_differently_still_agree(monkeypatch) -> None:
    # Each rank alone would pick a different s: rank r finds s = 2**r cheapest.
    def timed(work, s):
        return 1e-6 * s if s == 2 ** COMM.rank else 1.0 * s

    monkeypatch.setattr(_auto, "_time_local", timed)
    X, y = make_data("logistic", m=512)
    est = GLM("logistic", s="auto", batch_size=8, max_iter=1, tol=None, random_state=0).fit(X, y, comm=COMM)
    chosen = COMM.allgather_object(est.s_)
    assert len(set(chosen)) == 1, chosen
    # with every rank's time MAX-reduced no candidate is cheap: of the uniform 1 s per step (plus
    # messages), the smallest s modelled within MARGIN of the least wins
    auto = est.result_.auto
    modelled = dict(zip(auto.candidates, auto.step_s))
    least = min(modelled.values())
    assert auto.compute_s[0] == 1.0
    assert est.s_ == min(s for s, t in modelled.items() if t <= least * (1 + _auto.MARGIN))


@pytest.mark.parametrize("s", ["bogus", 0])
def test_a_bad_s_raises_the_same_error_on_every_rank(s) -> None:
    X, y = make_data("logistic", m=128)
    with pytest.raises(ValueError) as info:
        GLM("logistic", s=s, batch_size=8).fit(X, y, comm=COMM)
    messages = COMM.allgather_object(str(info.value))
    assert len(set(messages)) == 1 and f"s={s!r}" in messages[0], messages
    COMM.barrier()  # nobody was left inside a collective
