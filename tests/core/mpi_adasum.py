"""Adasum all-reduce on several ranks against a float64 numpy reference — tier 2 (mpiexec, CPU).

Run by tests/core/test_adasum.py as ``mpiexec -n {1,2,4,8} python -m pytest``
on this file; every rank runs the same tests in the same order. Each rank's
input is a deterministic function of (case, rank), so every rank builds all
inputs and computes the expected result itself with ``adasum_reference``.

Tolerances, norm-wise ``‖got - want‖ / ‖want‖`` against the float64 reference
on the same (already rounded) inputs, with ``L = log2(ranks)`` tree levels:
float16, bfloat16 and float32 ``2 · L · eps(dtype)``: each level's result is
computed in float64 and rounded once to the data dtype (measured on 2-8
ranks: at most 0.22 · L · eps on random vectors, 0.41 · L · eps on one-element
tensors). Parallel vectors with mixed signs (Horovod's ``test_parallel``) are
ill-conditioned — a level's rounding leaves a small vector slightly off the
common direction and the next level's large coefficient amplifies that — and
measured up to 10.5 · L · eps over ten seeds, so that case allows 16 times more
(Horovod's own test allows 100 · eps). float64: ``1e-12``
(summation order of the dot products). The largest element error must also
stay within ``4 ·`` that tolerance times ``max |want|``. Cases that are exact
by construction (disjoint supports → plain sum, identical inputs → the input
itself, zeros) are compared bit for bit.
"""

from __future__ import annotations

import hashlib
import math

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from commwire.comm.adasum import adasum_allreduce

try:  # the reference's BLAS threads stall when several ranks share the cores
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
except ImportError:
    pass

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
LEVELS = max(int(math.log2(SIZE)), 1)
DTYPES = ["float16", "bfloat16", "float32", "float64"]
ZERO_NORMSQ = math.sqrt(np.finfo(np.float64).tiny)  # a squared norm below this counts as zero (as in Horovod)


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def eps(name: str) -> float:
    return float(ml_dtypes.finfo(np_dtype(name)).eps)


def tolerance(name: str) -> float:
    return 1e-12 if name == "float64" else 2 * LEVELS * eps(name)


# -------------------------------------------------------------- reference
def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Combine two float64 vectors by the Adasum rule (a near-zero norm gives coefficient 1)."""
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2.0 * aa) if aa >= ZERO_NORMSQ else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb >= ZERO_NORMSQ else 1.0
    return ca * a + cb * b


def adasum_reference(arrays: list[np.ndarray], counts: list[int] | None = None) -> np.ndarray:
    """Return the Adasum tree reduction of ``arrays`` (rank order) in float64.

    Level 1 combines (0, 1), (2, 3), …; each later level combines neighbouring
    results. With ``counts``, each tensor of the flat buffer is reduced on its own.
    """
    shape = arrays[0].shape
    flat = [np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays]
    if counts is not None:
        offsets = np.concatenate(([0], np.cumsum(counts)))
        parts = [adasum_reference([f[s:e] for f in flat]) for s, e in zip(offsets[:-1], offsets[1:])]
        return np.concatenate(parts).reshape(shape)
    assert len(flat) & (len(flat) - 1) == 0, "the reference tree needs a power-of-two count"
    while len(flat) > 1:
        flat = [adasum_pair(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    return flat[0].reshape(shape)


# ---------------------------------------------------------------- helpers
def one_input(case: int, shape: tuple[int, ...] | int, dtype: str, rank: int) -> np.ndarray:
    """Return rank's input for ``case`` (standard normal, rounded to ``dtype``)."""
    return np.random.default_rng([case, rank]).standard_normal(shape).astype(np_dtype(dtype))


def inputs(case: int, shape: tuple[int, ...] | int, dtype: str, ranks: int = SIZE) -> list[np.ndarray]:
    """Return every rank's input for ``case``."""
    return [one_input(case, shape, dtype, r) for r in range(ranks)]


def check_close(got: np.ndarray, want: np.ndarray, dtype: str, widen: float = 1) -> None:
    assert got.dtype == np_dtype(dtype) and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    g = got.astype(np.float64)
    scale = float(np.linalg.norm(want))
    err = float(np.linalg.norm(g - want)) / scale if scale else float(np.linalg.norm(g))
    tol = widen * tolerance(dtype)
    assert err <= tol, f"{dtype}: relative error {err:.3g} > {tol:.3g}"
    if want.size:
        worst = float(np.max(np.abs(g - want)))
        assert worst <= 4 * tol * float(np.max(np.abs(want))) or worst == 0, f"{dtype}: element error {worst:.3g}"


def same_on_every_rank(comm: MPI.Comm, x: np.ndarray) -> bool:
    everyone = comm.allgather(hashlib.sha256(x.tobytes()).hexdigest())
    return all(h == everyone[0] for h in everyone)


def bits(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1).view(np.uint8)


# ---------------------------------------------------- the reference itself
def test_reference_pair_rule():
    a, b = np.array([3.0, 0.0]), np.array([1.0, 1.0])
    # a·b = 3, ‖a‖² = 9, ‖b‖² = 2: (1 - 3/18) a + (1 - 3/4) b
    np.testing.assert_allclose(adasum_reference([a, b]), (5 / 6) * a + 0.25 * b, rtol=1e-15)
    np.testing.assert_array_equal(adasum_reference([np.zeros(2), b]), b)
    np.testing.assert_array_equal(adasum_reference([a, a]), a)


def test_reference_tree_order():
    xs = inputs(1, 5, "float64", ranks=4)
    want = adasum_pair(adasum_pair(xs[0], xs[1]), adasum_pair(xs[2], xs[3]))
    np.testing.assert_array_equal(adasum_reference(xs), want)
    other = adasum_pair(adasum_pair(xs[0], xs[2]), adasum_pair(xs[1], xs[3]))
    assert not np.allclose(want, other)  # the pairing matters


def test_reference_orthogonal_is_sum_and_parallel_is_mean():
    q = np.linalg.qr(np.random.default_rng(2).standard_normal((9, 8)))[0]
    cols = [q[:, i] for i in range(8)]
    np.testing.assert_allclose(adasum_reference(cols), q.sum(axis=1), atol=1e-14)
    a, r = np.random.default_rng(3).standard_normal(6), np.array([1.0, -2.0, 0.5, 3.0])
    np.testing.assert_allclose(adasum_reference([s * a for s in r]), r.mean() * a, rtol=1e-13)


# ---------------------------------------------------- against the reference
SIZES = [1, 2, 3, 5, 7, 2 * SIZE + 1, 20 * SIZE - 17, 1000, 4097, 65537]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(dtype, n):
    xs = inputs(10 + n, n, dtype)
    got = adasum_allreduce(WORLD, xs[RANK])
    assert same_on_every_rank(WORLD, got)  # collective first: a failed check must not strand the others
    check_close(got, adasum_reference(xs), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_million_elements(dtype):
    n = 1_000_000
    got = adasum_allreduce(WORLD, one_input(11, n, dtype, RANK))
    same = same_on_every_rank(WORLD, got)
    failure = None
    if RANK == 0:  # one rank builds the reference; every rank learns the verdict
        try:
            check_close(got, adasum_reference(inputs(11, n, dtype)), dtype)
        except AssertionError as exc:
            failure = str(exc)
    failure = WORLD.bcast(failure)
    assert same and failure is None, failure


@pytest.mark.parametrize("dtype", DTYPES)
def test_shape_is_kept(dtype):
    xs = inputs(12, (3, 5, 7), dtype)
    got = adasum_allreduce(WORLD, xs[RANK])
    assert got.shape == (3, 5, 7)
    check_close(got, adasum_reference(xs), dtype)


def test_input_is_not_modified_and_result_is_new():
    x = inputs(13, 33, "float32")[RANK]
    before = x.copy()
    got = adasum_allreduce(WORLD, x)
    np.testing.assert_array_equal(x, before)
    assert not np.shares_memory(got, x)


def test_non_contiguous_input():
    xs = [x[::2] for x in inputs(14, 40, "float64")]
    got = adasum_allreduce(WORLD, xs[RANK])
    check_close(got, adasum_reference(xs), "float64")


def test_empty_array():
    got = adasum_allreduce(WORLD, np.zeros((0, 3), np.float32))
    assert got.shape == (0, 3) and got.dtype == np.float32


# ------------------------------------------------------ special vectors
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [SIZE, 3 * SIZE + 1, 1001])
def test_disjoint_supports_give_the_exact_sum(dtype, n):
    xs = inputs(20, n, dtype)
    for r, x in enumerate(xs):
        x[np.arange(n) % SIZE != r] = 0  # rank r owns every SIZE-th element: orthogonal by construction
    got = adasum_allreduce(WORLD, xs[RANK])
    np.testing.assert_array_equal(bits(got), bits(sum(xs[1:], xs[0])))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [SIZE + 2, 20 * SIZE - 17, 4099])
def test_orthogonal_vectors_give_the_sum(dtype, n):
    q = np.linalg.qr(np.random.default_rng(21).standard_normal((n, SIZE)))[0]
    xs = [q[:, r].astype(np_dtype(dtype)) for r in range(SIZE)]
    got = adasum_allreduce(WORLD, xs[RANK])
    check_close(got, adasum_reference(xs), dtype)
    # Rounded to the data dtype the columns are orthogonal only to within eps: allow that on top.
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    err = np.linalg.norm(got.astype(np.float64) - total) / np.linalg.norm(total)
    assert err <= tolerance(dtype) + 2 * eps(dtype), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 4097])
def test_identical_vectors_give_the_vector_itself(dtype, n):
    x = inputs(22, n, dtype, ranks=1)[0]  # the same on every rank
    got = adasum_allreduce(WORLD, x)
    np.testing.assert_array_equal(bits(got), bits(x))  # not SIZE * x: coefficients are exactly 1/2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("signs", ["positive", "mixed"])
def test_parallel_vectors_give_the_mean(dtype, signs):
    a = np.random.default_rng(23).standard_normal(1025)
    r = np.random.default_rng(24).uniform(0.5, 2, SIZE)
    if signs == "mixed":  # as in Horovod's test: the two scaled terms of a pair then partly cancel
        r = np.random.default_rng(24).standard_normal(SIZE)
    widen = 16 if signs == "mixed" else 1  # see the module docstring
    xs = [(s * a).astype(np_dtype(dtype)) for s in r]
    got = adasum_allreduce(WORLD, xs[RANK])
    check_close(got, adasum_reference(xs), dtype, widen)
    # Rounded to the data dtype the vectors are parallel only to within eps: allow that on top.
    mean = np.mean([x.astype(np.float64) for x in xs], axis=0)
    err = np.linalg.norm(got.astype(np.float64) - mean) / np.linalg.norm(mean)
    assert err <= widen * tolerance(dtype) + 2 * eps(dtype), err


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero(dtype):
    x = np.zeros(17, np_dtype(dtype))
    got = adasum_allreduce(WORLD, x)
    np.testing.assert_array_equal(bits(got), bits(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_ranks", ["even", "odd", "all_but_last"])
def test_some_ranks_zero(dtype, zero_ranks):
    xs = inputs(25, 301, dtype)
    chosen = {"even": lambda r: r % 2 == 0, "odd": lambda r: r % 2 == 1, "all_but_last": lambda r: r < SIZE - 1}
    for r, x in enumerate(xs):
        if chosen[zero_ranks](r):
            x[:] = 0
    got = adasum_allreduce(WORLD, xs[RANK])
    check_close(got, adasum_reference(xs), dtype)
    if zero_ranks == "all_but_last" or (zero_ranks == "even" and SIZE == 2):  # adasum(0, b) = b, exactly
        np.testing.assert_array_equal(bits(got), bits(xs[-1]))


def magnitude_range(dtype: str) -> tuple[float, float]:
    """Return the smallest and largest scale a rank's vector may have (Horovod's stability tests)."""
    if dtype == "float64":  # squared norms must stay within float64: 1e-70..1e70 keeps them in 1e-140..1e145
        return 1e-70, 1e70
    info = ml_dtypes.finfo(np_dtype(dtype))
    return float(info.smallest_normal), math.sqrt(float(info.max)) / 8  # / 8: room for |N(0,1)| <= 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_magnitudes(dtype):
    small, _ = magnitude_range(dtype)
    a = np.random.default_rng(26).standard_normal(1024)
    r = np.random.default_rng(27).uniform(1, 2, SIZE)
    xs = [(s * small * a).astype(np_dtype(dtype)) for s in r]  # parallel, near the smallest normal number
    got = adasum_allreduce(WORLD, xs[RANK])
    want = adasum_reference(xs)
    # float16/bfloat16/float32: values below the smallest normal are subnormal (fewer significant bits);
    # compare with an absolute tolerance of L ulps of the smallest subnormal on top of the usual one.
    ulp = float(ml_dtypes.finfo(np_dtype(dtype)).smallest_subnormal)
    err = np.linalg.norm(got.astype(np.float64) - want)
    assert err <= tolerance(dtype) * np.linalg.norm(want) + LEVELS * ulp * math.sqrt(want.size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_magnitudes(dtype):
    small, large = magnitude_range(dtype)
    a = np.random.default_rng(28).standard_normal(1024)
    scales = [large ** ((i + 1) / SIZE) * small ** ((SIZE - i - 1) / SIZE) for i in range(SIZE)]
    np.random.default_rng(29).shuffle(scales)
    xs = [(s * a).astype(np_dtype(dtype)) for s in scales]
    got = adasum_allreduce(WORLD, xs[RANK])
    check_close(got, adasum_reference(xs), dtype)
    assert np.all(np.isfinite(got.astype(np.float64)))


def test_float64_norm_below_threshold_counts_as_zero():
    xs = inputs(30, 64, "float64")
    xs[0] *= 1e-80  # ‖x0‖² ~ 1e-158 < sqrt(DBL_MIN): treated as a zero vector, as Horovod does
    got = adasum_allreduce(WORLD, xs[RANK])
    check_close(got, adasum_reference(xs), "float64")


def test_nan_propagates():
    x = inputs(31, 9, "float32")[RANK]
    if RANK == 0:
        x[4] = np.nan
    got = adasum_allreduce(WORLD, x)
    assert np.isnan(got).all() or SIZE == 1


# ----------------------------------------------------------- fused tensors
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("counts", [[5, 1, 13], [0, 7, 0, 3], [1] * 9, [4097, 3, 2000]])
def test_counts_reduce_each_tensor_on_its_own(dtype, counts):
    xs = inputs(40 + len(counts), sum(counts), dtype)
    got = adasum_allreduce(WORLD, xs[RANK], counts=counts)
    assert same_on_every_rank(WORLD, got)  # collective first: a failed check must not strand the others
    check_close(got, adasum_reference(xs, counts), dtype)


def test_counts_differ_from_one_tensor():
    if SIZE == 1:
        return
    xs = inputs(45, 40, "float64")
    fused = adasum_allreduce(WORLD, xs[RANK], counts=[20, 20])
    whole = adasum_allreduce(WORLD, xs[RANK])
    assert not np.allclose(fused, whole)


@pytest.mark.parametrize("counts", [[3, 3], [-1, 11], []])
def test_bad_counts_raise(counts):
    with pytest.raises(ValueError, match="counts="):
        adasum_allreduce(WORLD, np.zeros(10, np.float32), counts=counts)


# ------------------------------------------------------- errors and comms
@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "complex64"])
def test_non_float_dtype_raises(dtype):
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        adasum_allreduce(WORLD, np.zeros(4, dtype))


def test_non_numpy_input_raises():
    with pytest.raises(TypeError, match="numpy array"):
        adasum_allreduce(WORLD, [1.0, 2.0])


def test_non_power_of_two_ranks_raise():
    if SIZE < 4:
        pytest.skip("needs 4 or more ranks to form a group of 3")
    comm = WORLD.Split(int(RANK < 3), RANK)
    try:
        n = comm.Get_size()
        if n & (n - 1):
            with pytest.raises(NotImplementedError, match=f"power-of-two number of ranks, got {n}"):
                adasum_allreduce(comm, np.ones(4, np.float32))
        else:
            np.testing.assert_array_equal(adasum_allreduce(comm, np.ones(4, np.float32)), np.ones(4))
    finally:
        comm.Free()


def test_sub_communicators():
    half = max(SIZE // 2, 1)
    comm = WORLD.Split(RANK // half, RANK)
    members = comm.allgather(RANK)
    try:
        xs = inputs(50, 123, "float32")
        got = adasum_allreduce(comm, xs[RANK])
        check_close(got, adasum_reference([xs[r] for r in members]), "float32")
    finally:
        comm.Free()  # also frees the private duplicate (MPI attribute delete callback)
    again = WORLD.Dup()
    try:
        xs = inputs(51, 10, "float64")
        check_close(adasum_allreduce(again, xs[RANK]), adasum_reference(xs), "float64")
    finally:
        again.Free()


def test_pending_application_receive_is_not_matched():
    # An application receive for ANY source and ANY tag stays pending through the
    # reduction: Adasum's messages travel in a private context.
    buf = np.zeros(1, np.float64)
    req = WORLD.Irecv(buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    xs = inputs(52, 77, "float64")
    got = adasum_allreduce(WORLD, xs[RANK])
    pending = not req.Test()
    WORLD.Barrier()  # every rank has tested before any application message is sent
    WORLD.Send(np.array([RANK + 0.5]), dest=(RANK + 1) % SIZE, tag=7)
    req.Wait()
    assert pending
    assert buf[0] == (RANK - 1) % SIZE + 0.5
    check_close(got, adasum_reference(xs), "float64")
    WORLD.Barrier()
