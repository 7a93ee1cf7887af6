"""s="auto": candidates, the timed-candidate pruning, the chosen s, s_ and bad input — tier 1 (single process).

The choice itself is checked against a cost written out by hand in
tests/core/test_costmodel.py; agreement across ranks and errors on every rank are
in mpi_auto.py (run by test_mpi.py under mpiexec).
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


def test_candidates_keep_the_panel_small_and_fit_the_rows() -> None:
    assert _auto.candidates(4, 20_000) == (1, 2, 4, 8, 16, 32, 64)
    assert _auto.candidates(16, 20_000) == (1, 2, 4, 8, 16, 32)  # s*b <= MAX_ROWS = 512
    assert _auto.candidates(16, 100) == (1, 2, 4)  # s*b <= m
    assert _auto.candidates(1024, 4096) == (1,)


def test_timing_stops_once_work_per_step_grows_past_the_best_step() -> None:
    seen = []

    def work(s: int, exchanges: int) -> float:
        seen.append(s)
        return {1: 20e-6, 2: 12e-6, 4: 24e-6, 8: 80e-6}.get(s, 1.0)  # per step 20, 6, 6, 10 µs, then huge

    def step(s: int, c: float) -> float:
        return c / s + 5e-6 / s  # a latency of 5 µs per exchange

    times = _auto._time_candidates(work, (1, 2, 4, 8, 16, 32), step)
    assert times[:4] == [20e-6, 12e-6, 24e-6, 80e-6] and times[4:] == [math.inf, math.inf]
    assert 16 not in seen and 32 not in seen
    # while the work per step still falls (the loop's fixed cost spreads out), nothing is skipped
    falling = _auto._time_candidates(lambda s, k: 40e-6, (1, 2, 4, 8), lambda s, c: 1e-6)
    assert math.inf not in falling


def test_auto_picks_the_modelled_best_and_keeps_the_iterates() -> None:
    X, y = make_data("logistic", m=512)
    blocks = glm.from_array(X, y, comm=COMM)
    steps = 75
    result = glm.solve(blocks, loss="logistic", s="auto", batch_size=8, lr=0.05, max_steps=steps, tol=None, seed=3,
                       comm=COMM)
    auto = result.auto
    assert isinstance(auto, glm.AutoS) and result.s == auto.s in auto.candidates == _auto.candidates(8, 512)
    finite = {s: t for s, t in zip(auto.candidates, auto.step_s) if math.isfinite(t)}
    least = min(finite.values())
    assert auto.s == min(s for s, t in finite.items() if t <= least * (1 + _auto.MARGIN))
    # one rank: no messages, so the modelled step is the measured work per exchange over s
    for s, t, c in zip(auto.candidates, auto.step_s, auto.compute_s):
        assert t == pytest.approx(c / s) or (math.isinf(t) and math.isinf(c))
    assert auto.allreduces == 0 and auto.link is None and auto.tune_s > 0
    assert result.n_exchanges == math.ceil(steps / result.s)
    w_ref, _ = sgd(X, y, "logistic", glm.batch_indices(512, 8, steps, seed=3), 0.05, 0.0)
    assert rel(result.coef, w_ref) < 1e-10  # any s: FP64 CA-SGD is SGD


def test_auto_uses_the_fitted_link(monkeypatch) -> None:
    # A slow link (as measured on several ranks) makes the largest s pay, through the same model.
    slow = costmodel.LinkModel(alpha=1e-3, beta=1e-12)
    monkeypatch.setattr(_auto, "_link", lambda p, nbytes, seconds: slow)

    class TwoRanks:  # a communicator whose collectives are local: what _auto sees on 2 ranks
        size, rank = 2, 0

        def allreduce(self, x, op="sum", *, out=None, name=None):
            return x

        def broadcast_object(self, obj, root=0):
            return obj

    work = lambda s, k: 1e-5 * s  # noqa: E731 - work per step flat: messages decide
    auto = _auto.choose(TwoRanks(), 4, 20_000, np.float32, work)
    assert auto.s == 64 and auto.link is slow and auto.allreduces > 0
    assert len(auto.allreduce_s) == len(auto.candidates)


def test_glm_exposes_the_s_it_used() -> None:
    X, y = make_data("logistic", m=512)
    est = GLM("logistic", s="auto", batch_size=16, max_iter=2, tol=None, random_state=0).fit(X, y)
    assert est.s_ == est.result_.s == est.result_.auto.s and est.get_params()["s"] == "auto"
    assert est.n_iter_ == 2 and est.score(X, y) > 0.8
    assert GLM("logistic", s=4, batch_size=16, max_iter=1).fit(X, y).s_ == 4
    assert GLM("logistic", solver="sgd", s="auto", batch_size=16, max_iter=1).fit(X, y).s_ == 1


@pytest.mark.parametrize("s, match", [
    ("bogus", r"s='bogus' is not supported; give a positive integer .* or 'auto'"),
    ("AUTO", r"s='AUTO' is not supported"),
    (0, r"s=0 must be a positive integer or 'auto'"),
    (-2, r"s=-2 must be a positive integer or 'auto'"),
    (2.5, r"s=2.5 must be a positive integer or 'auto'"),
    (True, r"s=True must be a positive integer or 'auto'"),
])
def test_bad_s_is_refused_before_any_work(s, match: str) -> None:
    X, y = make_data("logistic", m=64)
    with pytest.raises(ValueError, match=match):
        glm.SolverConfig(s=s)
    with pytest.raises(ValueError, match=match):
        GLM("logistic", s=s, batch_size=16).fit(X, y)


def test_unresolved_auto_has_no_steps_per_exchange_and_small_data_still_fits() -> None:
    with pytest.raises(ValueError, match=r"s='auto' is chosen when solve runs; read FitResult.s"):
        _ = glm.SolverConfig(s="auto").steps_per_exchange
    X, y = make_data("least_squares", m=40)
    result = glm.solve(glm.from_array(X, y, comm=COMM), loss="least_squares", s="auto", batch_size=16, max_iter=2,
                       tol=None, comm=COMM)
    assert result.s in (1, 2) and result.auto.candidates == (1, 2)
    with pytest.raises(ValueError, match=r"batch_size=64 exceeds the 40 rows; lower batch_size"):
        glm.solve(glm.from_array(X, y, comm=COMM), loss="least_squares", s="auto", batch_size=64, comm=COMM)
