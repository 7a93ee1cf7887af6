"""Fuzz the collectives with random shapes, dtypes, ops and values — tier 2 (mpiexec).

Every rank runs the same hypothesis examples (derandomized, no database) and
builds its input from (example seed, rank), so each rank can compute the
reference of every rank's data in float64 itself. A verdict is agreed with an
all-reduce before asserting, so a failure is seen by all ranks at the same
example and shrinking stays in step.

Profiles: "ci" (default, a few hundred examples) and "soak" (10,000 per test):
    mpiexec -n 3 python -m pytest tests/reliability/mpi_fuzz.py --hypothesis-profile soak
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import commwire as cw

COMM = cw.init()
# Profiles "ci" and "soak" are registered in conftest.py.

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8"]
TOL = {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}
shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


def _dt(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _data(seed: int, rank: int, shape: tuple[int, ...], dtype: str, special: bool) -> np.ndarray:
    rng = np.random.default_rng(seed * 7919 + rank)
    if dtype in ("int32", "int64", "uint8"):
        return rng.integers(0, 4, size=shape).astype(dtype)
    x = rng.uniform(-3, 3, size=shape)
    if special and x.size:
        x.flat[rng.integers(x.size)] = rng.choice([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-30])
    return x.astype(_dt(dtype))


def _agree(ok: bool, detail: str) -> None:
    flags = COMM.allgather_object((ok, detail))
    bad = [(r, d) for r, (o, d) in enumerate(flags) if not o]
    assert not bad, bad


def _close(got: np.ndarray, want: np.ndarray, dtype: str) -> bool:
    if got.shape != want.shape:
        return False
    g = got.astype(np.float64)
    if dtype not in TOL:
        return bool(np.array_equal(g, want))
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(g), finite) and not (np.isnan(want) | np.isinf(want)).any():
        return False
    return bool(np.allclose(g[finite], want[finite], rtol=TOL[dtype], atol=TOL[dtype] * 3 * COMM.size))


@given(seed=st.integers(0, 2**20), shape=shapes, dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(["sum", "avg", "min", "max"]), special=st.booleans(), inplace=st.booleans())
def test_allreduce_fuzz(seed, shape, dtype, op, special, inplace):
    if op == "avg" and dtype in ("int32", "int64", "uint8"):
        op = "sum"
    special = special and dtype not in ("int32", "int64", "uint8")
    x = _data(seed, COMM.rank, shape, dtype, special)
    got = COMM.allreduce(x, op, out=x if inplace else None)
    stack = np.stack([_data(seed, r, shape, dtype, special).astype(np.float64) for r in range(COMM.size)])
    with np.errstate(invalid="ignore"):
        want = {"sum": stack.sum(0), "avg": stack.mean(0), "min": stack.min(0), "max": stack.max(0)}[op]
    if special:  # NaN/Inf: only require that non-finite stays non-finite where the reference is
        ok = got.shape == want.shape and bool(np.all(~np.isfinite(got.astype(np.float64))[~np.isfinite(want)]))
    else:
        ok = _close(got, want, dtype) and got.dtype == x.dtype
    _agree(ok, f"allreduce {op} {dtype} {shape}")


@given(seed=st.integers(0, 2**20), rows=st.integers(0, 5), tail=shapes, dtype=st.sampled_from(DTYPES),
       kind=st.sampled_from(["allgather", "broadcast", "reduce_scatter", "alltoall"]))
def test_moves_fuzz(seed, rows, tail, dtype, kind):
    tail = tail[:2]
    if kind == "allgather":
        x = _data(seed, COMM.rank, (rows + COMM.rank,) + tail, dtype, False)
        got = COMM.allgather(x)
        want = np.concatenate([_data(seed, r, (rows + r,) + tail, dtype, False) for r in range(COMM.size)])
        ok = bool(np.array_equal(got, want))
    elif kind == "broadcast":
        x = _data(seed, COMM.rank, (rows,) + tail, dtype, False)
        root = seed % COMM.size
        ok = bool(np.array_equal(COMM.broadcast(x, root), _data(seed, root, (rows,) + tail, dtype, False)))
    elif kind == "alltoall":
        x = _data(seed, COMM.rank, (rows * COMM.size,) + tail, dtype, False)
        got = COMM.alltoall(x)
        want = np.concatenate([_data(seed, r, (rows * COMM.size,) + tail, dtype, False)[
            COMM.rank * rows:(COMM.rank + 1) * rows] for r in range(COMM.size)])
        ok = bool(np.array_equal(got, want))
    else:
        x = _data(seed, COMM.rank, (rows,) + tail, dtype, False)
        got = COMM.reduce_scatter(x, "sum")
        total = np.sum([_data(seed, r, (rows,) + tail, dtype, False).astype(np.float64)
                        for r in range(COMM.size)], axis=0)
        ok = _close(got, np.array_split(total, COMM.size)[COMM.rank], dtype)
    _agree(ok, f"{kind} {dtype} rows={rows} tail={tail}")


BOUND = {"bf16": 2e-2, "fp8-e4m3": 0.08, "fp8-e5m2": 0.15, "nvfp4": 0.3, "ef+fp8-e4m3": 0.08}


@given(seed=st.integers(0, 2**20), n=st.integers(0, 5000), codec=st.sampled_from(sorted(BOUND)),
       op=st.sampled_from(["sum", "avg"]), special=st.booleans())
def test_compressed_allreduce_fuzz(seed, n, codec, op, special):
    x = _data(seed, COMM.rank, (n,), "float32", special)
    got = cw.allreduce(x, op, codec=codec, name=f"fuzz-{codec}-{n}")  # error feedback: one key per size
    stack = np.stack([_data(seed, r, (n,), "float32", special).astype(np.float64) for r in range(COMM.size)])
    want = stack.sum(0) / (COMM.size if op == "avg" else 1)
    if special:
        ok = got.shape == want.shape and bool(np.all(~np.isfinite(got)[~np.isfinite(want)]))
    else:
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        ok = got.shape == want.shape and (n == 0 or err < BOUND[codec])
    same = len(set(COMM.allgather_object(got.tobytes()))) == 1  # identical on every rank
    _agree(ok and same, f"{codec} {op} n={n} special={special}")
