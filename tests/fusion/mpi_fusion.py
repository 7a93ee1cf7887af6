"""FusionBuffer on several ranks with numpy arrays — tier 2 (run by test_fusion.py).

Reference: a separate plain all-reduce of each tensor; fused results must be
bit-identical for float64 sums (same elements, same reduction).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import commwire as cw
from commwire.fusion import FusionBuffer

COMM = cw.init()


def tensors(rank: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(rank)
    shapes = [(3, 4), (4,), (10, 10), (1,), (7, 3), (5,)]
    out = [(f"t{i}", rng.standard_normal(s)) for i, s in enumerate(shapes)]
    out.append(("half", rng.standard_normal(6).astype(np.float32)))  # another dtype: its own bucket
    return out


@pytest.mark.parametrize("threshold,first", [(1 << 20, 1 << 20), (200, 64), (0, 0)])
@pytest.mark.parametrize("overlap", [True, "lane", False])
def test_fused_equals_per_tensor_allreduce(threshold, first, overlap):
    named = tensors(COMM.rank)
    fb = FusionBuffer(named, op="sum", threshold_bytes=threshold, first_bucket_bytes=first, overlap=overlap)
    if threshold == 0:
        assert len(fb.buckets) == len(named)
    for name, value in reversed(named):  # any order: launches still follow bucket order
        fb.add(name, value)
    reduced = fb.wait()
    for name, value in named:
        np.testing.assert_array_equal(reduced[name], COMM.allreduce(value, "sum"))
        assert reduced[name].shape == value.shape


def test_buckets_reverse_order_dtype_and_first_bucket():
    named = tensors(0)
    fb = FusionBuffer(named, threshold_bytes=400, first_bucket_bytes=100)
    order = [n for b in fb.buckets for n in b.names]
    f64 = [n for n, v in reversed(named) if v.dtype == np.float64]
    assert [n for n in order if n != "half"] == f64
    assert all(len({named[[n for n, _ in named].index(x)][1].dtype for x in b.names}) == 1 for b in fb.buckets)
    assert fb.buckets[0].nbytes <= 100 or len(fb.buckets[0].names) == 1
    ids = [b.id for b in FusionBuffer(named, threshold_bytes=400, first_bucket_bytes=100).buckets]
    assert ids == [b.id for b in fb.buckets]  # stable across rebuilds


def test_missing_tensors_are_zero_filled_and_rounds_repeat():
    named = tensors(COMM.rank)
    fb = FusionBuffer(named, op="avg", threshold_bytes=300)
    for step in range(3):
        for name, value in named[1:]:
            fb.add(name, value * step)
        assert fb.missing() == ["t0"]
        reduced = fb.wait()
        np.testing.assert_array_equal(reduced["t0"], np.zeros((3, 4)))
        np.testing.assert_allclose(reduced["t1"], COMM.allreduce(named[1][1] * step, "avg"))


def test_errors():
    named = tensors(COMM.rank)
    with pytest.raises(ValueError, match="unique"):
        FusionBuffer(named + [named[0]])
    fb = FusionBuffer(named, threshold_bytes=0, overlap=False)
    with pytest.raises(KeyError, match="not registered"):
        fb.add("nope", np.zeros(1))
    for name, value in named:
        fb.add(name, value)
    with pytest.raises(RuntimeError, match="call wait"):
        fb.add("t0", named[0][1])
    fb.wait()
    with pytest.raises(ValueError, match="overlap='yes'"):
        FusionBuffer(named, overlap="yes")


def grads(rank: int, step: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(100 * rank + step)
    sizes = [200000, 190000, 3000, 64000, 7]  # filled last first: ~256 KiB, then 1.5 MiB (the ring on 3+ ranks)
    return [(f"g{i}", rng.standard_normal(n).astype(np.float32)) for i, n in enumerate(sizes)]


CHECKED = {}


def comm_checking(check):
    """The world, or a duplicate that agrees on every call (check=True, as commwire.torch's process sets)."""
    if check == "first":
        return COMM
    if check not in CHECKED:
        CHECKED[check] = COMM.duplicate(check=check)
    return CHECKED[check]


@pytest.mark.parametrize("check", ["first", True])
@pytest.mark.parametrize("overlap", [True, "lane", False])
def test_rounds_move_on_the_callers_thread_beside_other_collectives(overlap, check):
    # overlap=True: the buckets move on the caller's thread, a test per add() (with check="first"
    # from the second round: the first agrees each bucket's signature, on the lane); a blocking
    # all-reduce and lane work on the same communicator meanwhile (the lane's worker finishes
    # stepped work first).
    from unittest import mock

    from commwire.comm import ring, transport

    with mock.patch.object(ring, "ONE_NODE", True), \
            mock.patch.object(transport, "ring_steps", wraps=transport.ring_steps) as ring_calls:  # in steps
        comm = comm_checking(check)
        fb = FusionBuffer(grads(COMM.rank, 0), op="avg", threshold_bytes=2 << 20, first_bucket_bytes=256 << 10,
                          overlap=overlap, comm=comm)
        assert [b.nbytes for b in fb.buckets] == [4 * 64007, 4 * 393000]
        for step in range(4):
            values = grads(COMM.rank, step)
            for name, value in reversed(values):
                fb.add(name, value)
            kinds = {type(b.handle).__name__ for b in fb.buckets}
            stepped = overlap is True and (step or check is True) and COMM.transport.steps
            assert kinds == ({"_Stepped"} if stepped else {"_Deferred"} if overlap is False
                             else {"_FutureHandle"}), kinds
            if stepped and step == 2:  # tests alone (no wait) finish stepped work
                deadline = time.monotonic() + 60
                while not all(b.handle.done for b in fb.buckets):
                    comm.progress()
                    assert time.monotonic() < deadline
            side = lane = None
            if step % 2:
                side = comm.allreduce(np.full(3, COMM.rank + step, np.float64), name="side")
                lane = comm.allreduce_async(np.arange(4.0) * COMM.rank, name="lane")
            reduced = fb.wait()
            for i, (name, _) in enumerate(values):
                want = np.mean([grads(r, step)[i][1].astype(np.float64) for r in range(COMM.size)], axis=0)
                np.testing.assert_allclose(reduced[name], want, rtol=1e-5, atol=1e-6)
            assert len(set(COMM.allgather_object(fb.buckets[1].buffer.tobytes()))) == 1  # the same bits everywhere
            if step % 2:
                np.testing.assert_array_equal(side, np.full(3, sum(range(COMM.size)) + COMM.size * step))
                np.testing.assert_array_equal(lane.wait(), np.arange(4.0) * sum(range(COMM.size)))
    assert ring_calls.called == (COMM.size >= 3 and COMM.transport.name == "mpi")


@pytest.mark.parametrize("check", ["first", True])
@pytest.mark.parametrize("n", [300_000, 30])  # the flag beside the data, or in the buffer (check="first")
def test_a_rank_that_deviates_in_stepped_work_raises_on_every_rank(n, check):
    comm = comm_checking(check)
    x = np.full(n, 1.0 + COMM.rank, np.float32)
    total = sum(1.0 + r for r in range(COMM.size))

    def whole(comm, x):
        return comm.allreduce(x, name="dev")

    def steps(comm, x):
        return comm.allreduce_steps(x, name="dev")

    np.testing.assert_array_equal(comm.start(steps, whole, x).wait(), total)  # check="first": agrees, on the lane
    handle = comm.start(steps, whole, x)
    assert (type(handle).__name__ == "_Stepped") == COMM.transport.steps
    np.testing.assert_array_equal(handle.wait(), total)
    bad = x if COMM.rank else x[:-1]  # rank 0: another shape under the same name
    with pytest.raises(ValueError, match="shape"):
        comm.start(steps, whole, bad).wait()
    np.testing.assert_array_equal(comm.start(steps, whole, x).wait(), total)  # and the communicator goes on
    with pytest.raises(TypeError, match="dtype"):  # bad arguments on one rank: every rank raises
        comm.start(steps, whole, x if COMM.rank else x.astype(np.complex64)).wait()
    np.testing.assert_array_equal(comm.start(steps, whole, x).wait(), total)


def test_compressed_buckets():
    named = [(f"w{i}", np.random.default_rng(COMM.rank * 10 + i).standard_normal(5000).astype(np.float32))
             for i in range(4)]
    fb = FusionBuffer(named, op="avg", codec="fp8-e4m3", threshold_bytes=40_000)
    for name, value in named:
        fb.add(name, value)
    reduced = fb.wait()
    for name, value in named:
        want = COMM.allreduce(value.astype(np.float64), "avg")
        assert np.linalg.norm(reduced[name] - want) / np.linalg.norm(want) < 0.06
