"""Collectives on several ranks against a numpy reference — tier 2 (mpiexec, CPU).

Run by tests/core/test_mpi.py as ``mpiexec -n {1,2,4} python -m pytest`` on this
file; every rank runs the same tests in the same order. Each rank's input is a
deterministic function of (rank, case), so every rank computes the expected
result itself in float64.

Tolerances (relative, against the float64 reference): float64 1e-12,
float32 1e-5 (reduction order), float16 1e-3 and bfloat16 1e-2 (one rounding of
the float32 sum to the half format); integers and pure data moves are exact.
The suite runs on three communicators (world, a duplicate, and a split into
halves) and two array kinds (numpy, torch CPU).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import commwire as cw

torch = pytest.importorskip("torch")

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8"]
from mpi_helpers import check_close  # noqa: E402
WORLD = cw.init()


def _split() -> cw.Communicator:
    return WORLD.split(color=WORLD.rank % 2 if WORLD.size > 1 else 0, key=WORLD.rank)


COMMS = {"world": WORLD, "dup": WORLD.derive(MPI.COMM_WORLD.Dup()), "split": _split()}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def data(rank: int, shape: tuple[int, ...], dtype: str, case: int = 0) -> np.ndarray:
    """Return rank's deterministic input; small integers keep integer sums exact."""
    rng = np.random.default_rng(1000 * case + rank)
    if dtype in ("int32", "int64", "uint8"):
        return rng.integers(0, 5, size=shape).astype(dtype)
    return rng.uniform(-2, 2, size=shape).astype(np_dtype(dtype))


def as_kind(a: np.ndarray, kind: str):
    if kind == "numpy":
        return a
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(x, dtype: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    assert isinstance(x, torch.Tensor), type(x)
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def group_ranks(comm: cw.Communicator) -> list[int]:
    return comm.allgather_object(WORLD.rank)


REFERENCE = {
    "sum": lambda xs: np.sum(xs, axis=0),
    "avg": lambda xs: np.mean(xs, axis=0),
    "min": lambda xs: np.min(xs, axis=0),
    "max": lambda xs: np.max(xs, axis=0),
}


@pytest.mark.parametrize("comm_name", list(COMMS))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_allreduce(comm_name, kind, dtype, op):
    comm = COMMS[comm_name]
    if op == "avg" and dtype in ("int32", "int64", "uint8"):
        with pytest.raises(TypeError, match="avg"):
            comm.allreduce(as_kind(data(0, (3,), dtype), kind), op)
        return
    shape = (5, 3)
    members = group_ranks(comm)
    x = as_kind(data(WORLD.rank, shape, dtype), kind)
    got = comm.allreduce(x, op)
    assert type(got) is type(x)
    assert got.dtype == x.dtype
    want = REFERENCE[op](np.stack([data(r, shape, dtype).astype(np.float64) for r in members]))
    check_close(to_numpy(got, dtype), want, dtype)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "bfloat16"])
def test_allreduce_in_place_and_out(kind, dtype):
    x = as_kind(data(WORLD.rank, (7,), dtype), kind)
    want = np.sum([data(r, (7,), dtype).astype(np.float64) for r in range(WORLD.size)], axis=0)
    got = WORLD.allreduce(x, "sum", out=x)
    assert got is x
    check_close(to_numpy(x, dtype), want, dtype)
    y = as_kind(data(WORLD.rank, (7,), dtype), kind)
    out = as_kind(np.zeros(7, dtype=np_dtype(dtype)), kind)
    assert WORLD.allreduce(y, "sum", out=out) is out
    check_close(to_numpy(out, dtype), want, dtype)
    check_close(to_numpy(y, dtype), data(WORLD.rank, (7,), dtype).astype(np.float64), dtype)  # input untouched


def test_allreduce_non_contiguous_is_copied_not_misread():
    base = data(WORLD.rank, (6, 4), "float64")
    view = base[:, ::2]  # strided view
    got = WORLD.allreduce(view)
    want = np.sum([data(r, (6, 4), "float64")[:, ::2] for r in range(WORLD.size)], axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    t = torch.from_numpy(base.copy()).t()  # non-contiguous tensor
    np.testing.assert_allclose(WORLD.allreduce(t).numpy(), np.sum(
        [data(r, (6, 4), "float64").T for r in range(WORLD.size)], axis=0), rtol=1e-12)


@pytest.mark.parametrize("check", ["first", False, True])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("n", [7, 50_000])  # the fused small all-reduce; the plain one
def test_a_strided_out_receives_the_result(check, kind, n):
    comm = WORLD.duplicate(check=check)
    want = np.sum([data(r, (n,), "float64") for r in range(WORLD.size)], axis=0)
    for call in range(2):  # the first call of the name, then a steady-state one
        x = as_kind(data(WORLD.rank, (n,), "float64"), kind)
        out = as_kind(np.full(2 * n, -1.0), kind)[::2]  # every other element of a larger array
        assert comm.allreduce(x, out=out, name="strided") is out
        np.testing.assert_allclose(to_numpy(out, "float64"), want, rtol=1e-12, err_msg=f"call {call}")
        inplace = as_kind(np.repeat(data(WORLD.rank, (n,), "float64"), 2), kind)[::2]  # strided, reduced in place
        assert comm.allreduce(inplace, out=inplace, name="strided.a") is inplace
        np.testing.assert_allclose(to_numpy(inplace, "float64"), want, rtol=1e-12, err_msg=f"call {call}")
        y = as_kind(np.full(2 * n, float(WORLD.rank)), kind)[::2]
        assert comm.broadcast(y, root=WORLD.size - 1, out=y, name="strided.b") is y  # in place, strided
        np.testing.assert_array_equal(to_numpy(y, "float64"), np.full(n, WORLD.size - 1.0))
        into = as_kind(np.zeros(2 * n), kind)[::2]
        assert comm.broadcast(as_kind(np.full(n, float(WORLD.rank)), kind), root=0, out=into, name="strided.c") is into
        np.testing.assert_array_equal(to_numpy(into, "float64"), np.zeros(n))
    comm.free()


@pytest.mark.parametrize("comm_name", list(COMMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_async_variants_match_blocking(comm_name, dtype):
    comm = COMMS[comm_name]
    x = data(WORLD.rank, (9,), dtype)
    handles = [
        comm.allreduce_async(x, "max"),
        comm.allgather_async(x),
        comm.broadcast_async(x, root=0),
        comm.reduce_scatter_async(x, "sum"),
    ]
    for h in handles[::-1]:  # completion order need not match start order
        h.wait()
    while not all(h.test() for h in handles):
        pass
    check_close(handles[0].wait(), comm.allreduce(x, "max").astype(np.float64), dtype)
    np.testing.assert_array_equal(handles[1].wait(), comm.allgather(x))
    np.testing.assert_array_equal(handles[2].wait(), comm.broadcast(x, root=0))
    check_close(handles[3].wait(), comm.reduce_scatter(x, "sum").astype(np.float64), dtype)


@pytest.mark.parametrize("comm_name", list(COMMS))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_unequal_rows(comm_name, kind, dtype):
    comm = COMMS[comm_name]
    members = group_ranks(comm)
    x = as_kind(data(WORLD.rank, (WORLD.rank + 1, 2), dtype), kind)
    got = to_numpy(comm.allgather(x), dtype)
    want = np.concatenate([data(r, (r + 1, 2), dtype) for r in members])
    np.testing.assert_array_equal(got, want)


def test_allgather_scalars_and_empty():
    got = WORLD.allgather(np.float64(WORLD.rank) * np.ones(()))
    np.testing.assert_array_equal(got, np.arange(WORLD.size, dtype=np.float64))
    empty = WORLD.allgather(np.zeros((0, 3), dtype=np.float32))
    assert empty.shape == (0, 3)


def test_allgather_mismatched_trailing_shape_raises_everywhere():
    x = np.zeros((1, 2 + (WORLD.rank == 0 and WORLD.size > 1)), dtype=np.float32)
    if WORLD.size == 1:
        return
    with pytest.raises(ValueError, match="trailing shape"):
        WORLD.allgather(x)


@pytest.mark.parametrize("comm_name", list(COMMS))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(comm_name, kind, dtype):
    comm = COMMS[comm_name]
    members = group_ranks(comm)
    root = comm.size - 1
    x = as_kind(data(WORLD.rank, (4, 3), dtype), kind)
    got = to_numpy(comm.broadcast(x, root=root), dtype)
    np.testing.assert_array_equal(got, data(members[root], (4, 3), dtype))
    y = data(WORLD.rank, (4, 3), dtype)
    assert comm.broadcast(y, root=0, out=y) is y
    np.testing.assert_array_equal(y, data(members[0], (4, 3), dtype))


@pytest.mark.parametrize("comm_name", list(COMMS))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_reduce_scatter(comm_name, kind, dtype, rows):
    comm = COMMS[comm_name]
    members = group_ranks(comm)
    x = as_kind(data(WORLD.rank, (rows, 2), dtype), kind)
    got = to_numpy(comm.reduce_scatter(x, "sum"), dtype)
    total = np.sum([data(r, (rows, 2), dtype).astype(np.float64) for r in members], axis=0)
    want = np.array_split(total, comm.size)[comm.rank]
    check_close(got, want, dtype)


@pytest.mark.parametrize("comm_name", list(COMMS))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall(comm_name, kind, dtype):
    comm = COMMS[comm_name]
    members = group_ranks(comm)
    k = 3
    x = as_kind(data(WORLD.rank, (comm.size * k, 2), dtype), kind)
    got = to_numpy(comm.alltoall(x), dtype)
    want = np.concatenate([data(r, (comm.size * k, 2), dtype)[comm.rank * k:(comm.rank + 1) * k] for r in members])
    np.testing.assert_array_equal(got, want)


def test_alltoall_bad_length():
    if WORLD.size == 1:
        return
    with pytest.raises(ValueError, match="divisible"):
        WORLD.alltoall(np.zeros(WORLD.size + 1))


def test_objects_and_barrier():
    assert WORLD.broadcast_object({"a": WORLD.rank}, root=0) == {"a": 0}
    assert WORLD.allgather_object(WORLD.rank * 2) == [2 * r for r in range(WORLD.size)]
    WORLD.barrier()
    cw.barrier()


def test_module_level_functions_use_world():
    got = cw.allreduce(np.ones(3) * cw.rank())
    np.testing.assert_array_equal(got, np.full(3, sum(range(cw.size())), dtype=np.float64))
    assert cw.local_size() >= 1 and 0 <= cw.local_rank() < cw.local_size()


def test_new_group():
    ranks = list(range(0, WORLD.size, 2))
    group = cw.new_group(ranks)
    if WORLD.rank in ranks:
        assert group is not None and group.size == len(ranks)
        np.testing.assert_array_equal(group.allreduce(np.ones(2)), np.full(2, float(len(ranks))))
    else:
        assert group is None
    with pytest.raises(ValueError, match="distinct ranks"):
        cw.new_group([0, 0])


def test_bad_op_and_dtype_errors():
    with pytest.raises(ValueError, match="op='median' is not supported"):
        WORLD.allreduce(np.ones(2), "median")
    with pytest.raises(TypeError, match="complex128 is not supported"):
        WORLD.allreduce(np.ones(2, dtype=np.complex128))
    with pytest.raises(TypeError, match="numpy.asarray"):
        WORLD.allreduce([1.0, 2.0])
    with pytest.raises(ValueError, match="root=99"):
        WORLD.broadcast(np.ones(2), root=99)


def test_check_mode_reports_every_rank():
    if WORLD.size == 1:
        return
    checked = WORLD.derive(MPI.COMM_WORLD.Dup())
    checked.check = True
    bad = np.ones(3 + (WORLD.rank == 1), dtype=np.float32)
    with pytest.raises(cw.CollectiveMismatchError) as info:
        checked.allreduce(bad, name="grad.w")
    text = str(info.value)
    assert "shape differs" in text and "rank 0: (3,)" in text and "rank 1: (4,)" in text
    with pytest.raises(cw.CollectiveMismatchError, match="op differs"):
        checked.allreduce(np.ones(2), "sum" if WORLD.rank else "max")
    np.testing.assert_array_equal(checked.allreduce(np.ones(2)), np.full(2, float(WORLD.size)))


def test_stats_count_calls_bytes_and_reset():
    cw.stats(reset=True)
    WORLD.allreduce(np.ones(10, dtype=np.float32))
    WORLD.allreduce(np.ones(6, dtype=np.float64))
    h = WORLD.allreduce_async(np.ones(4, dtype=np.float32))
    h.wait()
    snap = cw.stats(reset=True)
    assert snap["allreduce"]["calls"] == 3
    assert snap["allreduce"]["bytes"] == 40 + 48 + 16
    assert snap["allreduce"]["time_s"] > 0
    assert cw.stats()["codecs"] == {} and "allreduce" not in cw.stats()


def test_default_first_call_check_catches_a_mismatch_without_any_flag():
    assert WORLD.check == "first"
    if WORLD.size == 1:
        return
    with pytest.raises(cw.CollectiveMismatchError, match="shape differs"):
        WORLD.allreduce(np.ones(3 + (WORLD.rank == 1)), name="first-call-check")
    np.testing.assert_array_equal(WORLD.allreduce(np.ones(2), name="first-call-ok"), np.full(2, float(WORLD.size)))
    np.testing.assert_array_equal(WORLD.allreduce(np.ones(2), name="first-call-ok"), np.full(2, float(WORLD.size)))


@pytest.mark.parametrize("comm_name", list(COMMS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [(1 << 18) + 3, 3 * (1 << 18) + 1])
def test_large_sums_blocking_async_in_place(comm_name, dtype, n):
    # From 1 MiB the mpi transport sums floats by its own ring (commwire.comm.ring) on 3 ranks
    # or more: against the float64 reference, the same bits on every rank, and the same
    # result blocking, in place, averaged and on the lane.
    from unittest import mock

    from commwire.comm import transport as transport_mod
    from commwire.comm.ring import RING_BYTES

    comm = COMMS[comm_name]
    ranks = group_ranks(comm)
    x = data(WORLD.rank, (n,), dtype, case=7)
    want = np.sum([data(r, (n,), dtype, case=7).astype(np.float64) for r in ranks], axis=0)
    # ONE_NODE: take the ring on this one machine too (it otherwise serves ranks spread over nodes)
    with mock.patch.object(transport_mod, "ring_steps", wraps=transport_mod.ring_steps) as ring, \
            mock.patch.object(transport_mod.ring_mod, "ONE_NODE", True):
        got = comm.allreduce(x, name="big")
    assert ring.called == (comm.transport.name == "mpi" and comm.size >= 3 and x.nbytes >= RING_BYTES)
    check_close(got, want, dtype)
    assert np.isfinite(got).all() and np.abs(got).max() > 0.1
    assert len(set(comm.allgather_object(got.tobytes()))) == 1  # identical on every rank
    with mock.patch.object(transport_mod.ring_mod, "ONE_NODE", True):
        inplace = x.copy()
        assert comm.allreduce(inplace, out=inplace, name="big-in-place") is inplace
        np.testing.assert_array_equal(inplace, got)
        np.testing.assert_array_equal(comm.allreduce_async(x, name="big-async").wait(), got)
        check_close(comm.allreduce(x, "avg", name="big-avg"), want / comm.size, dtype)
        with mock.patch.object(transport_mod.ring_mod, "SEGMENT_BYTES", 1000):  # many uneven segments per block
            np.testing.assert_array_equal(comm.allreduce(x, name="big-segments"), got)
    check_close(comm.allreduce(x, name="big-mpi"), want, dtype)  # one node: MPI's own all-reduce
