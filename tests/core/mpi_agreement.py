"""Every rank learns a collective's verdict together — tier 2 (mpiexec -n 2 and 4, CPU).

Run by tests/core/test_agreement.py as ``mpiexec -n {2,4} python -m pytest`` on
this file. In each case one rank (the last) passes a bad argument, or the ranks
disagree; every rank must raise the same exception type within a second, and
the next collective must pair up and give the right result. Each case runs as a
first call (a fresh name: descriptor exchange), after an agreed call of the same
name (steady state: the deviation flag, fused into small all-reduces or beside
the data otherwise) and on a communicator with ``check=True`` (every call).
Results are compared with values each rank computes itself (exact: the inputs
are small integers).
"""

from __future__ import annotations

import itertools
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

import commwire as cw

torch = pytest.importorskip("torch")

WORLD = cw.init()
CHECKED = WORLD.duplicate(check=True)
P, R = WORLD.size, WORLD.rank
BAD = P - 1  # the rank that passes the bad argument
_names = itertools.count()

pytestmark = pytest.mark.skipif(P < 2, reason="needs at least two ranks")


def fresh(label: str) -> str:
    return f"{label}.{next(_names)}"  # the same on every rank: tests run in the same order


# case -> (function of (comm, name, bad) running the collective, the exception every rank raises,
#          a function of (comm, name) running a valid call of the same name first)
def _allreduce(shape, dtype="float32", op="sum"):
    return lambda comm, name, bad: comm.allreduce(np.ones(shape, dtype=dtype), op, name=name)


CASES = {
    "unsupported dtype": (lambda c, n, bad: c.allreduce(np.ones(3, np.complex64 if bad else np.float32), name=n),
                          TypeError),
    "avg of integers": (lambda c, n, bad: c.allreduce(np.ones(3, np.int32 if bad else np.float32), "avg", name=n),
                        TypeError),
    "bad op": (lambda c, n, bad: c.allreduce(np.ones(3, np.float32), "median" if bad else "sum", name=n),
               ValueError),
    "mismatched shape (small)": (lambda c, n, bad: c.allreduce(np.ones(3 + bad, np.float32), name=n),
                                 cw.CollectiveMismatchError),
    "mismatched shape (large)": (lambda c, n, bad: c.allreduce(np.ones(50_000 + bad, np.float32), name=n),
                                 cw.CollectiveMismatchError),
    "mismatched dtype, torch": (lambda c, n, bad: c.allreduce(torch.ones(7, dtype=torch.int32 if bad else
                                                                          torch.float32), name=n),
                                RuntimeError),
    "mismatched shape, torch (small)": (lambda c, n, bad: c.allreduce(torch.ones(3 + bad), name=n),
                                        cw.CollectiveMismatchError),
    "mismatched shape, torch (large, in place)": (lambda c, n, bad: (lambda t: c.allreduce(t, out=t, name=n))(
        torch.ones(50_000 + bad)), cw.CollectiveMismatchError),
    "out of the wrong shape": (lambda c, n, bad: c.allreduce(np.ones(4), out=np.empty(5 if bad else 4), name=n),
                               ValueError),
    "root out of range": (lambda c, n, bad: c.broadcast(np.ones(3), root=99 if bad else 0, name=n), ValueError),
    "roots differ": (lambda c, n, bad: c.broadcast(np.ones(3), root=1 if bad else 0, name=n),
                     cw.CollectiveMismatchError),
    "broadcast dtype": (lambda c, n, bad: c.broadcast(np.ones(3, np.int16 if bad else np.float32), name=n),
                        cw.CollectiveMismatchError),
    "allgather trailing shape": (lambda c, n, bad: c.allgather(np.ones((2, 3 + bad)), name=n),
                                 cw.CollectiveMismatchError),
    "allgather dtype": (lambda c, n, bad: c.allgather(np.ones(2, np.complex128 if bad else np.float64), name=n),
                        TypeError),
    "reduce_scatter scalar": (lambda c, n, bad: c.reduce_scatter(np.ones(() if bad else (P,)), name=n),
                              ValueError),
    "reduce_scatter adasum": (lambda c, n, bad: c.reduce_scatter(np.ones(P), "adasum" if bad else "sum", name=n),
                              NotImplementedError),
    "alltoall length": (lambda c, n, bad: c.alltoall(np.ones(P + bad), name=n), ValueError),
    "alltoall splits too long": (lambda c, n, bad: c.alltoallv(np.ones(P), [1] * P if not bad else [2] * P, name=n),
                                 ValueError),
    "broadcast_object root": (lambda c, n, bad: c.broadcast_object("x", root=-1 if bad else 0, name=n), ValueError),
}


def _valid(case: str, comm: cw.Communicator, name: str) -> None:
    """Run the case once with every rank's arguments valid (makes the name's next call a steady-state one)."""
    CASES[case][0](comm, name, False)


def _expect_everywhere(fn, exc_type) -> float:
    """Run ``fn`` and return how long it took to raise ``exc_type`` (fails if it returns)."""
    start = time.perf_counter()
    with pytest.raises(exc_type) as info:
        fn()
    assert f"of {P}" in str(info.value), str(info.value)  # the message says which rank and how many
    return time.perf_counter() - start


def _next_collective_works(comm: cw.Communicator) -> None:
    got = comm.allreduce(np.full(3, R + 1.0), name="after")
    np.testing.assert_array_equal(got, np.full(3, P * (P + 1) / 2))


@pytest.mark.parametrize("mode", ["first", "steady", "checked"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_raises_together(case, mode):
    fn, exc_type = CASES[case]
    comm = CHECKED if mode == "checked" else WORLD
    name = fresh(case)
    if mode == "steady":
        _valid(case, comm, name)
    took = _expect_everywhere(lambda: fn(comm, name, R == BAD), exc_type)
    assert took < 1.0, f"{case}: raised after {took:.2f} s"
    _next_collective_works(comm)
    # the name stays usable with valid arguments
    _valid(case, comm, name)


@pytest.mark.parametrize("n", [3, 100_000])  # the flag in the buffer (fast path's fused all-reduce); beside it
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_cpu_tensors_take_the_numpy_fast_path_with_exact_results(n, dtype, monkeypatch):
    general = []
    slow = cw.Communicator._allreduce
    monkeypatch.setattr(cw.Communicator, "_allreduce", lambda self, *a: general.append(a) or slow(self, *a))
    name = fresh("tensor")
    base = torch.arange(n, dtype=torch.float64) % 97
    want = (base * P + P * (P - 1) / 2).to(dtype)  # sum over ranks of base + r, exact in every dtype here
    for call in range(4):
        x = (base + R).to(dtype)
        if call % 2:
            got = WORLD.allreduce(x, name=name)
            assert got is not x and torch.equal(x, (base + R).to(dtype))  # the input is left alone
        else:
            got = WORLD.allreduce(x, out=x, name=name)
            assert got is x
        assert type(got) is torch.Tensor and got.dtype == dtype and torch.equal(got, want), call
    assert len(general) == 1  # only the first call (the agreement) took the general path
    if dtype.is_floating_point:
        avg = name + ".avg"
        for _ in range(2):  # agreed, then the fast path
            got = WORLD.allreduce((base + R).to(dtype), "avg", name=avg)
            torch.testing.assert_close(got, want / P, rtol=1e-6, atol=0)
        assert len(general) == 2


def test_tensors_the_fast_path_cannot_view_take_the_general_path_with_exact_results(monkeypatch):
    general = []
    slow = cw.Communicator._allreduce
    monkeypatch.setattr(cw.Communicator, "_allreduce", lambda self, *a: general.append(a) or slow(self, *a))
    cases = {"bfloat16": lambda: torch.full((8,), R + 1.0, dtype=torch.bfloat16),
             "requires_grad": lambda: torch.full((8,), R + 1.0, requires_grad=True),
             "strided": lambda: torch.full((8, 2), R + 1.0)[:, 0],
             "other out": lambda: torch.full((8,), R + 1.0)}
    for label, make in cases.items():
        name = fresh(label)
        for _ in range(2):  # the second call is a steady-state one: the fast path would take it if it could
            before = len(general)
            x = make()
            if label == "other out":
                out = torch.empty(8)
                got = WORLD.allreduce(x, out=out, name=name)
                assert got is out
            else:
                got = WORLD.allreduce(x, name=name)
            assert len(general) == before + 1, label
            assert torch.equal(got.detach().float(), torch.full((len(got),), P * (P + 1) / 2)), label


def _count_general(monkeypatch) -> list:
    general = []
    slow = cw.Communicator._allreduce
    monkeypatch.setattr(cw.Communicator, "_allreduce", lambda self, *a: general.append(a) or slow(self, *a))
    return general


@pytest.mark.parametrize("n", [3, 100_000])  # below and above the small all-reduce's size
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_check_false_repeats_take_the_fast_path_with_exact_results(n, dtype, monkeypatch):
    general = _count_general(monkeypatch)
    loose = WORLD.duplicate(check=False)
    name = fresh("loose")
    base = np.arange(n) % 97
    want = (base * P + P * (P - 1) // 2).astype(dtype)  # sum over ranks of base + r, exact in every dtype here
    other = np.empty(n, dtype=dtype)
    for call in range(6):
        x = (base + R).astype(dtype)
        kind = call % 3
        got = loose.allreduce(x, out={0: None, 1: x, 2: other}[kind], name=name)
        assert got is {0: got, 1: x, 2: other}[kind] and got.dtype == x.dtype, call
        np.testing.assert_array_equal(got, want)
        if kind != 1:
            np.testing.assert_array_equal(x, (base + R).astype(dtype))  # the input is left alone
    t = torch.from_numpy((base + R).astype(dtype))
    assert torch.equal(loose.allreduce(t, name=name), torch.from_numpy(want))  # a CPU tensor: its numpy view
    assert len(general) == 1  # only the first call took the general path
    strided = np.zeros(2 * n, dtype=dtype)[::2]  # small: reduced in a copy on the fast path; large: general path
    assert loose.allreduce((base + R).astype(dtype), out=strided, name=name) is strided
    np.testing.assert_array_equal(strided, want)
    calls = len(general)
    assert calls == (1 if n < 1000 else 2)
    for length in (n + 128, n):  # a new shape for the name: checked again, then fast again
        got = loose.allreduce(np.full(length, R + 1, dtype=dtype), name=name)
        np.testing.assert_array_equal(got, np.full(length, P * (P + 1) // 2, dtype=dtype))
    assert len(general) == calls + 2
    if dtype.startswith("float"):
        for _ in range(2):
            got = loose.allreduce((base + R).astype(dtype), "avg", name=name)
            np.testing.assert_allclose(got, want / P, rtol=1e-6)
        assert len(general) == calls + 3
    with pytest.raises(TypeError, match="truncate"):  # checked on this rank as ever (every rank passes it)
        loose.allreduce((base + R).astype("int64"), "avg", name=name)
    loose.free()


def test_check_false_steps_after_the_first_call(monkeypatch):
    general = _count_general(monkeypatch)
    made = []
    steps = cw.Communicator.allreduce_steps

    def spy(comm, *args, **kwargs):
        gen = steps(comm, *args, **kwargs)
        made.append(gen is not None)
        return gen

    loose = WORLD.duplicate(check=False)
    for call in range(3):  # the lane's communicator knows the call after the first
        handle = loose.start(spy, cw.Communicator.allreduce, np.full(100_000, R + 1.0), name="stepped")
        loose.progress()
        np.testing.assert_array_equal(handle.wait(), np.full(100_000, P * (P + 1) / 2))
    assert len(general) == 1
    if loose.transport.steps and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        assert made == [False, True, True]  # the first call runs whole, the next two in steps
    loose.free()


@pytest.mark.parametrize("check", ["first", False])
def test_another_view_of_the_same_memory_is_reduced_in_place(check, monkeypatch):
    general = _count_general(monkeypatch)
    comm = WORLD if check else WORLD.duplicate(check=False)
    name = fresh("view")
    for call in range(3):
        t = torch.full((100_000,), R + 1.0)
        x, out = t.numpy(), t.numpy()  # two array objects over the tensor's memory
        got = comm.allreduce(x, out=out, name=name)
        assert got is out and torch.equal(t, torch.full((100_000,), P * (P + 1) / 2)), call
    assert len(general) == 1


def test_errors_name_each_ranks_value():
    name = fresh("named")
    with pytest.raises(cw.CollectiveMismatchError) as info:
        WORLD.allreduce(np.ones(3 + (R == BAD), np.float32), name=name)
    text = str(info.value)
    assert "shape differs" in text and "rank 0: (3,)" in text and f"rank {BAD}: (4,)" in text
    with pytest.raises(TypeError) as info:
        WORLD.allreduce(np.ones(3, np.int32 if R == BAD else np.float32), "avg", name=fresh("avg"))
    text = str(info.value)
    assert f"rank {BAD}: op='avg' on int32 would truncate" in text and "passed valid arguments" in text



def test_ranks_at_different_collectives_report_the_mismatch_over_a_local_error():
    # The last rank is one collective ahead (a loop that ended early elsewhere) and its own call is
    # also invalid: being out of step is the error every rank reports, its complaint listed after.
    with pytest.raises(cw.CollectiveMismatchError) as info:
        if R == BAD:
            WORLD.allreduce(np.ones(3, np.int32), "avg", name=fresh("ahead"))
        else:
            WORLD.broadcast(np.ones(3, np.float32), root=0, name=fresh("behind"))
    text = str(info.value)
    assert "operation differs" in text and f"rank {BAD} also failed: op='avg' on int32" in text
    assert isinstance(info.value, RuntimeError)  # what Horovod raises for ranks out of step
    _next_collective_works(WORLD)

@pytest.mark.parametrize("n", [5, 50_000])
def test_same_name_new_shape_on_every_rank_is_redone_not_raised(n):
    name = fresh("reshape")
    for length in (n, n + 3, n, 2 * n):  # every rank changes alike: agreed again, correct result
        got = WORLD.allreduce(np.full(length, R + 1, dtype=np.float64), name=name)
        np.testing.assert_array_equal(got, np.full(length, P * (P + 1) / 2))
        got = WORLD.allgather(np.full((R + 1, length % 7 + 1), R, dtype=np.int16), name=name)
        want = np.concatenate([np.full((r + 1, length % 7 + 1), r, dtype=np.int16) for r in range(P)])
        np.testing.assert_array_equal(got, want)
        got = WORLD.broadcast(np.full(length, R, dtype=np.int8), root=P - 1, name=name)
        np.testing.assert_array_equal(got, np.full(length, P - 1, dtype=np.int8))


def test_unnamed_calls_of_changing_shapes_and_dtypes():
    # Horovod's test suite calls unnamed collectives over a product of dtypes and shapes.
    for dtype, dim in itertools.product(["int8", "int16", "int32", "int64", "float16", "float32", "float64"],
                                        [1, 2, 3]):
        x = np.full([5] * dim, R + 1).astype(dtype)
        got = WORLD.allreduce(x)
        assert got.dtype == x.dtype and got.shape == x.shape
        np.testing.assert_array_equal(got.astype(np.float64), np.full([5] * dim, P * (P + 1) / 2))


def test_inplace_buffer_untouched_when_raising_on_a_peer():
    name = fresh("inplace")
    x = np.full(4, R + 1.0)
    WORLD.allreduce(x.copy(), out=None, name=name)
    y = np.full(4, R + 1.0) if R != BAD else np.full(4, R + 1.0).astype(np.complex128)
    with pytest.raises(TypeError):
        WORLD.allreduce(y, out=y, name=name)
    np.testing.assert_array_equal(y, np.full(4, R + 1.0))  # small all-reduces reduce a copy until agreed


def test_async_errors_raise_at_wait_on_every_rank():
    name = fresh("async")
    handle = WORLD.allreduce_async(np.ones(3 + (R == BAD), np.float32), name=name)
    with pytest.raises(cw.CollectiveMismatchError):
        handle.wait()
    ok = WORLD.allreduce_async(np.ones(3), name=name)
    np.testing.assert_array_equal(ok.wait(), np.full(3, float(P)))


def test_async_and_blocking_collectives_do_not_interleave():
    # an async op runs on the lane's own communicator: a barrier issued meanwhile pairs up
    handles = [WORLD.allreduce_async(np.full(1000, R + 1.0)), WORLD.allgather_async(np.full(2, R))]
    WORLD.barrier()
    np.testing.assert_array_equal(handles[0].wait(), np.full(1000, P * (P + 1) / 2))
    np.testing.assert_array_equal(handles[1].wait(), np.repeat(np.arange(P), 2))


@pytest.mark.parametrize("dtype", ["bool", "int8", "int16", "uint16", "uint32", "uint64"])
def test_small_integer_and_bool_dtypes(dtype):
    values = np.array([R % 2, 1, 0, R == 0], dtype=dtype)
    everyone = np.stack([np.array([r % 2, 1, 0, r == 0], dtype=dtype) for r in range(P)])
    np.testing.assert_array_equal(WORLD.allreduce(values, "max"), everyone.max(axis=0))
    np.testing.assert_array_equal(WORLD.allreduce(values, "min"), everyone.min(axis=0))
    if dtype != "bool":
        np.testing.assert_array_equal(WORLD.allreduce(values, "sum"), everyone.sum(axis=0).astype(dtype))
    else:
        with pytest.raises(TypeError, match="logical"):
            WORLD.allreduce(values, "sum")
    np.testing.assert_array_equal(WORLD.broadcast(values, root=P - 1), everyone[-1])
    np.testing.assert_array_equal(WORLD.allgather(values), everyone.reshape(-1))


@pytest.mark.parametrize("dtype", ["int32", "int64", "float32", "float64", "float16"])
def test_product(dtype):
    x = np.array([R + 1, 2, -1, 1], dtype=dtype)
    want = np.prod(np.stack([np.array([r + 1, 2, -1, 1], dtype=np.float64) for r in range(P)]), axis=0)
    np.testing.assert_array_equal(WORLD.allreduce(x, "prod").astype(np.float64), want)
    np.testing.assert_array_equal(WORLD.allreduce(torch.from_numpy(x), "product").numpy().astype(np.float64), want)


def test_alltoallv_uneven_splits():
    # rank r sends (r + 1) rows to every rank, each row holding the destination
    rows = np.repeat(np.arange(P), R + 1).astype(np.float32)
    got, received = WORLD.alltoallv(np.stack([rows, rows], axis=1), [R + 1] * P)
    assert received.tolist() == [r + 1 for r in range(P)]
    np.testing.assert_array_equal(got, np.full((P * (P + 1) // 2, 2), R, dtype=np.float32))
    prefix, received = WORLD.alltoallv(np.arange(2 * P + 3), [2] * P)  # rows past sum(splits) are not sent
    np.testing.assert_array_equal(prefix, np.concatenate([np.arange(2 * R, 2 * R + 2)] * P))


def test_join_counts_joined_ranks_as_zeros():
    for first in range(P):
        if R == first:
            last = CHECKED.join()
        else:
            summed = CHECKED.allreduce(np.full(5, R + 1.0), name="joined.a")
            averaged = CHECKED.allreduce(np.full(3, 2.0 * (R + 1)), "avg", name="joined.b")
            counted = CHECKED.allreduce(np.full(2, R + 1, dtype=np.int32), "sum", name="joined.c")
            want = sum(r + 1 for r in range(P) if r != first)
            np.testing.assert_array_equal(summed, np.full(5, float(want)))
            np.testing.assert_allclose(averaged, np.full(3, 2.0 * want / P))  # divides by every rank, as Horovod
            np.testing.assert_array_equal(counted, np.full(2, want, dtype=np.int32))
            with pytest.raises(RuntimeError, match="join"):
                CHECKED.allgather(np.ones(2), name="joined.gather")
            last = CHECKED.join()
        assert last != first or P == 1
        assert WORLD.allgather_object(last) == [last] * P


def test_join_needs_a_checked_communicator():
    with pytest.raises(RuntimeError, match="check=True"):
        WORLD.join()


def test_resync_waits_for_every_rank_and_fails_the_collectives_of_ranks_behind():
    # Rank BAD is behind by a reduce-scatter, an allgather and a broadcast: each raises there with
    # the waiting ranks named, the others wait in resync, and afterwards collectives pair up again.
    if R == BAD:
        calls = (lambda: CHECKED.reduce_scatter(np.ones(P * 2), name="behind.rs"),
                 lambda: CHECKED.allgather(np.ones(3), name="behind.ag"),
                 lambda: CHECKED.broadcast(np.ones(2), root=0, name="behind.bc"))
        for call in calls:
            with pytest.raises(cw.CollectiveMismatchError,
                               match=re.escape(f"rank(s) {list(range(P - 1))} wait in resync")):
                call()
    start = time.monotonic()
    CHECKED.resync()
    assert time.monotonic() - start < 30
    got = CHECKED.allreduce(np.full(4, R + 1.0), name="after.resync")
    np.testing.assert_array_equal(got, np.full(4, P * (P + 1) / 2))


def test_resync_refuses_to_wait_for_ranks_inside_join():
    if R == 0:
        assert CHECKED.join() == P - 1  # the others join after their resync failed: the last of them
    else:
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] of .* inside join\(\)"):
            CHECKED.resync()
        assert CHECKED.join() == P - 1
    with pytest.raises(RuntimeError, match="check=True"):
        WORLD.resync()


def test_check_false_skips_agreement():
    loose = WORLD.duplicate(check=False)
    np.testing.assert_array_equal(loose.allreduce(np.ones(2)), np.full(2, float(P)))
    with pytest.raises(TypeError):  # every rank passes the bad dtype: each raises on its own
        loose.allreduce(np.ones(2, np.complex64))


def test_mpi_is_still_in_step():
    MPI.COMM_WORLD.Barrier()
    assert WORLD.allgather_object(R) == list(range(P))
