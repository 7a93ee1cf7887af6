"""Straggler detection (``commwire.StragglerMonitor``) — tier 1 (one process) and tier 2 (2 and 4 ranks).

Tier 1: the scores and the text of a report from hand-made timings, the
monitor's window on one rank, and bad arguments. Tier 2 (``mpi_stragglers.py``
under mpiexec, 2 and 4 ranks over MPI, 2 over torch's gloo): the blocked time of
real waits and the slow rank named.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi_helpers import run_mpi_pytest

import commwire as cw
from commwire.comm import StragglerReport, blocked_seconds
from commwire.comm.stragglers import RankTiming


@pytest.fixture(scope="module", autouse=True)
def world():
    return cw.init()


def test_a_report_scores_own_work_against_the_fastest_rank():
    timings = (RankTiming(0, 10, 1.0, 0.6), RankTiming(1, 10, 1.0, 0.5), RankTiming(2, 10, 1.0, 0.0))
    # own work per step: 40, 50, 100 ms
    report = StragglerReport(window=0, timings=timings, relative=(1.0, 0.8, 0.4), individual=(1.0, 1.0, 1.0),
                             threshold=0.8)
    assert [t.work_ms_per_step for t in timings] == pytest.approx([40.0, 50.0, 100.0])
    assert report.stragglers == [2] and report.slowest == 2
    text = str(report)
    assert "rank 2 (0.40)" in text and "below relative score 0.8" in text
    assert "   2         100.0              0.0      0.40        1.00" in text


def test_one_rank_reports_every_window_and_is_its_own_fastest():
    mon = cw.StragglerMonitor(every=3, threshold=0.9)
    assert [mon.step() for _ in range(2)] == [None, None]
    time.sleep(0.01)
    report = mon.step()
    assert report.relative == (1.0,) and report.stragglers == [] and report.timings[0].steps == 3
    assert report.timings[0].wall_s >= 0.01 and mon.windows == 1


def test_the_calling_thread_counts_its_own_waits_only():
    before = blocked_seconds()
    cw.allreduce(np.ones(3), name="counted")
    assert blocked_seconds() > before


@pytest.mark.parametrize("kwargs,match", [({"every": 0}, "every=0"), ({"threshold": 0.0}, "threshold=0.0"),
                                          ({"threshold": 1.5}, "threshold=1.5")])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cw.StragglerMonitor(**kwargs)


@pytest.mark.mpi
@pytest.mark.parametrize("n,transport", [(2, "mpi"), (4, "mpi"), (2, "torch")])
def test_stragglers_on_several_ranks(n, transport):
    run_mpi_pytest(n, "tests/core/mpi_stragglers.py", timeout=120, transport=transport)


def test_the_user_guide_example_runs():
    from docs_examples import python_block

    printed = []
    namespace = {"loader": range(250), "train_step": lambda batch: None, "print": printed.append}
    exec(python_block("usage.md", "StragglerMonitor(every=100"), namespace)  # noqa: S102
    assert namespace["mon"].windows == 2 and printed == []  # one rank: nobody is slower than itself


def test_the_lab_study_reports_its_windows():
    from research import load

    bench = load("stragglers")
    rows = [{"arm": "even", "seed": 0, "windows": 5, "named_slow": 0, "named_other": 0, "slow_score": None,
             "min_other_score": 0.91, "ms_per_step": 50.0},
            {"arm": "slow", "seed": 0, "windows": 5, "named_slow": 5, "named_other": 0, "slow_score": 0.52,
             "min_other_score": 1.0, "ms_per_step": 80.0}]
    table = bench.summarize(rows)
    assert "| slow | 0 | 5 | 5 | 0 | 0.52 | 1.00 | 80.0 |" in table
    assert "slow: slow rank named alone in 5/5; another rank named in 0/5 windows" in table
    bench.main(["--quick", "--slow-rank", "0"])  # one process: a smoke run of the training loop


class _Rows:
    """A stand-in communicator whose all-gather returns the rows given (the ranks' windows)."""

    def __init__(self, *windows):
        self.windows = list(windows)

    def allgather(self, mine, name=None):
        return np.array(self.windows.pop(0), dtype=np.float64)


def test_report_scores_are_the_arithmetic_of_the_exchanged_timings():
    # per rank: steps, wall seconds, blocked seconds; own work per step = (wall - blocked) / steps
    comm = _Rows([[10, 1.0, 0.6], [10, 1.0, 0.55], [10, 1.0, 0.0]],   # 40, 45, 100 ms
                 [[10, 1.0, 0.2], [10, 1.0, 0.55], [10, 1.0, 0.0]])   # 80, 45, 100 ms
    mon = cw.StragglerMonitor(every=10, threshold=0.8, comm=comm)
    first = mon.report()
    assert first.relative == pytest.approx((1.0, 40 / 45, 0.4)) and first.stragglers == [2]
    assert first.individual == pytest.approx((1.0, 1.0, 1.0)) and first.window == 0
    second = mon.report()
    assert second.relative == pytest.approx((45 / 80, 1.0, 0.45)) and second.stragglers == [2, 0]  # slowest first
    assert second.individual == pytest.approx((0.5, 1.0, 1.0)) and mon.windows == 2 and mon.last is second
    assert [t.work_ms_per_step for t in second.timings] == pytest.approx([80.0, 45.0, 100.0])
