"""Blocked time and the straggler monitor on several ranks — tier 2 (run by test_stragglers.py).

A straggler is made by sleeping: every rank does ``WORK`` seconds of "own
work" per step, the slow rank ``SLOW`` times that; then one all-reduce. Checks:
the seconds a rank spends blocked waiting for a late rank are counted on the
waiting thread, once, in a blocking collective (first call and steady state), a
handle's wait and a lane's wait; the monitor names the slow rank with the same
report on every rank, and its numbers are the sleeps; nobody is named when the
ranks work alike; the individual score sees a rank that became slow.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import commwire as cw
from commwire.comm import blocked_seconds

COMM = cw.init()
P, R = COMM.size, COMM.rank
LAST = P - 1
WORK, SLOW = 0.05, 3.0

pytestmark = pytest.mark.skipif(P < 2, reason="needs at least two ranks")


def one_step(slow_rank: int | None) -> None:
    time.sleep(WORK * (SLOW if R == slow_rank else 1.0))
    cw.allreduce(np.ones(4), name="step")


def assert_waited(waited: float) -> None:
    if R == LAST:
        assert waited < 0.2
    else:
        assert 0.25 <= waited < 2.0  # counted, and not twice


@pytest.mark.parametrize("calls", [1, 3])
def test_a_blocking_collective_counts_the_wait_for_a_late_rank(calls):
    for i in range(calls):  # the last call of the same name is on the fast path (agreed before)
        COMM.barrier()
        before = blocked_seconds()
        if R == LAST:
            time.sleep(0.3)
        cw.allreduce(np.ones(8), name=f"late.{calls}")
    assert_waited(blocked_seconds() - before)


@pytest.mark.parametrize("how", ["handle", "lane"])
def test_waiting_for_a_handle_counts_once(how):
    COMM.barrier()
    before = blocked_seconds()
    if R == LAST:
        time.sleep(0.3)
    if how == "handle":
        handle = cw.allreduce_async(np.ones(8), name="late.async")
    else:
        handle = COMM.submit(lambda c, x: c.allreduce(x, name="late.lane"), np.ones(8), label="late.lane")
    np.testing.assert_array_equal(handle.wait(), P)
    assert_waited(blocked_seconds() - before)


def late_allreduce(name: str) -> float:
    """Return the blocked seconds of one all-reduce that the last rank joins 0.3 s late."""
    COMM.barrier()
    before = blocked_seconds()
    if R == LAST:
        time.sleep(0.3)
    cw.allreduce(np.ones(8), name=name)
    return blocked_seconds() - before


@pytest.mark.parametrize("drained", [False, True])
def test_a_stepped_bucket_counts_the_wait_not_the_computation_beside_it(drained):
    # DistributedOptimizer's buckets (overlap=True) move in steps on this thread while backward runs;
    # only the final wait may count. drained: work queued behind it makes the lane's thread finish it.
    from commwire.fusion import FusionBuffer

    x = np.ones(1 << 16, np.float32)
    fb = FusionBuffer([("g", x)], comm=COMM, op="sum", overlap=True)
    COMM.barrier()
    before = blocked_seconds()
    fb.add("g", x)
    after = COMM.submit(lambda c, y: c.allreduce(y, name="behind"), np.ones(4), label="behind") if drained else None
    start = time.perf_counter()
    while time.perf_counter() - start < 0.3:  # "backward", moving the collective on between layers
        COMM.progress()
        time.sleep(0.01)
    np.testing.assert_array_equal(fb.wait()["g"], P)
    if after is not None:
        np.testing.assert_array_equal(after.wait(), P)
    assert blocked_seconds() - before < 0.1
    assert_waited(late_allreduce(f"after.stepped.{drained}"))  # the account is whole again


def test_a_lanes_wait_is_not_the_calling_threads():
    COMM.barrier()
    before = blocked_seconds()
    if R == LAST:
        time.sleep(0.3)
    handle = COMM.submit(lambda c, y: c.allreduce(y, name="lane.only"), np.ones(4), label="lane.only")
    time.sleep(0.5)  # this thread computes while the lane waits for the last rank
    np.testing.assert_array_equal(handle.wait(), P)
    assert blocked_seconds() - before < 0.1


def test_the_monitor_names_the_slow_rank_on_every_rank():
    mon = cw.StragglerMonitor(every=5)
    for _ in range(4):
        one_step(LAST)
        assert mon.step() is None
    one_step(LAST)
    report = mon.step()
    assert report is not None and report.window == 0 and mon.last is report
    assert report.stragglers[0] == LAST and report.slowest == LAST
    assert report.relative[LAST] < 0.5 and min(report.relative[:LAST]) > 0.6
    # The numbers are the sleeps: own work 50 ms per step, 150 ms on the slow rank, which the others wait for.
    assert report.timings[LAST].work_ms_per_step == pytest.approx(1e3 * WORK * SLOW, rel=0.25)
    assert report.timings[0].work_ms_per_step == pytest.approx(1e3 * WORK, rel=0.3)
    assert report.timings[0].blocked_ms_per_step > 0.5 * 1e3 * WORK * (SLOW - 1)
    assert len(set(COMM.allgather_object(str(report)))) == 1
    assert f"rank {LAST} (" in str(report)


def test_nobody_is_named_when_the_ranks_work_alike_and_a_slowdown_shows_individually():
    mon = cw.StragglerMonitor(every=5)
    for _ in range(5):
        one_step(None)
        report = mon.step()
    assert report.stragglers == [] and min(report.relative) > 0.8
    for _ in range(5):
        one_step(0)  # rank 0 slows down
        report = mon.step()
    # 4 ranks on 2 cores: a waking rank may wait for a core, so only the slow rank's margin is asserted
    assert report.window == 1 and report.stragglers[0] == 0 and report.slowest == 0
    assert report.individual[0] < 0.5 and min(report.individual[1:]) > 0.6
