"""Compressed reduce-scatter and all-gather on several ranks — tier 2 (run under mpiexec by test_compressed.py).

Reference: the float64 reduce-scatter / concatenation of the same inputs. Documented
bounds on the relative L2 error (ONE quantisation per value — the sender's chunk for
reduce-scatter, each rank's shard for all-gather; Gaussian data): 1.5x the one-step
round trip of docs/formats.md.

| codec | bound | typical one-step round trip |
|---|---|---|
| fp16 | 5e-4 | ~3e-4 |
| bf16 | 4e-3 | ~2.3e-3 |
| fp8-e4m3 (tensor or block scales, hadamard) | 0.04 | 0.026 |
| fp8-e5m2 | 0.08 | 0.053 |
| nvfp4 (± hadamard) | 0.15 | 0.095 |
| mxfp8-e4m3 | 0.06 | 0.029 (a 4-element block at 2 ranks: 0.053) |
| mxfp4 | 0.2 | 0.115 (a 4-element block at 2 ranks: 0.170) |
| int8 | 0.01 | 0.0065 |
| int4 | 0.15 | 0.097 |
| sign | 0.7 | 0.60 (sqrt(1 - 2/pi); 7 rows at 2 ranks: 0.604) |
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

import commwire as cw
from commwire.codecs import get
from commwire.codecs.sharded import compressed_allgather, compressed_reduce_scatter

torch = pytest.importorskip("torch")

COMM = cw.init()
P = COMM.size
BOUNDS = {
    "fp16": 5e-4,
    "bf16": 4e-3,
    "fp8-e4m3": 0.04,
    "fp8-e4m3:block=32": 0.04,
    "hadamard+fp8-e4m3": 0.04,
    "fp8-e5m2": 0.08,
    "nvfp4": 0.15,
    "hadamard+nvfp4": 0.15,
    "mxfp8-e4m3": 0.06,
    "mxfp4": 0.2,
    "int8": 0.01,
    "int4": 0.15,
    "sign": 0.7,
}


def gaussian(shape, rank: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed * 1000 + rank).standard_normal(shape).astype(np.float32)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def same_everywhere(arr: np.ndarray) -> bool:
    return len(set(COMM.allgather_object(zlib.crc32(np.ascontiguousarray(arr).tobytes())))) == 1


def rs_reference(shape, op: str, counts, seed: int = 0) -> np.ndarray:
    total = np.sum([gaussian(shape, r, seed).astype(np.float64) for r in range(P)], axis=0)
    if op == "avg":
        total /= P
    edges = np.concatenate(([0], np.cumsum(counts)))
    return total[edges[COMM.rank]:edges[COMM.rank + 1]]


@pytest.mark.parametrize("spec", list(BOUNDS))
@pytest.mark.parametrize("rows", [1, 7, 1000, 50_001])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_error_bound(spec, rows, op):
    x = gaussian(rows, COMM.rank)
    got = compressed_reduce_scatter(COMM, x, op, codec=spec, name=f"rs-{spec}-{rows}-{op}")
    counts = [len(c) for c in np.array_split(np.arange(rows), P)]  # uneven blocks when P does not divide rows
    want = rs_reference(rows, op, counts)
    assert got.shape == want.shape and got.dtype == np.float32
    if want.size:
        err = rel_err(got, want)
        assert err < BOUNDS[spec], (spec, rows, op, err)


def test_reduce_scatter_counts_rows_and_torch():
    # 2-D rows, explicit uneven counts with an empty block, torch bfloat16 in and out
    counts = [5] + [3 * r for r in range(1, P)]
    if P > 2:
        counts[-1] = 0  # an empty block
    rows = sum(counts)
    x = gaussian((rows, 64), COMM.rank, seed=2)
    t = torch.from_numpy(x).to(torch.bfloat16)
    got = cw.reduce_scatter(t, "sum", codec="fp8-e4m3", counts=counts, name="rs-rows")
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert tuple(got.shape) == (counts[COMM.rank], 64)
    ref = np.sum([gaussian((rows, 64), r, seed=2).astype(ml_dtypes.bfloat16).astype(np.float64)
                  for r in range(P)], axis=0)
    edges = np.concatenate(([0], np.cumsum(counts)))
    want = ref[edges[COMM.rank]:edges[COMM.rank + 1]]
    if want.size:
        assert rel_err(got.float().numpy(), want) < 0.045
    out = torch.empty_like(got)
    same = compressed_reduce_scatter(COMM, t, "sum", codec="fp8-e4m3", counts=counts, out=out, name="rs-rows")
    assert same is out and torch.equal(out, got)


def test_codec_none_is_the_plain_collectives():
    x = gaussian((10, 3), COMM.rank, seed=4)
    np.testing.assert_array_equal(compressed_reduce_scatter(COMM, x, "avg", codec="none"),
                                  COMM.reduce_scatter(x, "avg"))
    np.testing.assert_array_equal(compressed_allgather(COMM, x[:COMM.rank + 1], codec="none"),
                                  COMM.allgather(x[:COMM.rank + 1]))


@pytest.mark.parametrize("spec", list(BOUNDS))
def test_allgather_error_bound_identical_everywhere(spec):
    # uneven shards: rank r holds 100*r + 1 rows (rank 0 one row)
    shards = [gaussian((100 * r + 1, 8), r, seed=6) for r in range(P)]
    got = cw.allgather(shards[COMM.rank], codec=spec, name=f"ag-{spec}")
    want = np.concatenate(shards).astype(np.float64)
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want) < BOUNDS[spec], spec
    assert same_everywhere(got)
    # every rank's own rows come back quantised like the others' (bit-identical results)
    assert not np.array_equal(got, want.astype(np.float32)) or spec in ("fp16",)


def test_allgather_counts_and_out():
    rows = [4] * P
    x = gaussian((4, 16), COMM.rank, seed=8)
    out = np.empty((4 * P, 16), np.float32)
    assert compressed_allgather(COMM, x, codec="fp8-e4m3", counts=rows, out=out, name="ag-out") is out
    want = np.concatenate([gaussian((4, 16), r, seed=8) for r in range(P)]).astype(np.float64)
    assert rel_err(out, want) < 0.04
    no_counts = compressed_allgather(COMM, x, codec="fp8-e4m3", name="ag-out")
    np.testing.assert_array_equal(no_counts, out)
    # in place, as FSDP gathers: the input is this rank's slot of the output (torch tensors)
    inplace = torch.zeros(4 * P, 16)
    inplace[4 * COMM.rank:4 * COMM.rank + 4] = torch.from_numpy(x)
    compressed_allgather(COMM, inplace[4 * COMM.rank:4 * COMM.rank + 4], codec="fp8-e4m3", counts=rows,
                         out=inplace, name="ag-out")
    np.testing.assert_array_equal(inplace.numpy(), out)


def test_wire_bytes_are_the_codecs():
    n = P << 14
    x = gaussian(n, COMM.rank)
    cw.stats(reset=True)
    cw.reduce_scatter(x, "sum", codec="fp8-e4m3", name="rs-bytes")
    cw.allgather(x[: n // P], codec="fp8-e4m3", counts=[n // P] * P, name="ag-bytes")
    snap = cw.stats(reset=True)
    # reduce-scatter: (P-1)/P of the tensor at 1 byte/element plus one 4-byte scale per chunk sent
    assert snap["compressed_reduce_scatter"]["bytes"] == (P - 1) * (n // P + 4)
    assert snap["compressed_reduce_scatter"]["input_bytes"] == 4 * n
    assert snap["compressed_allgather"]["bytes"] == n // P + 4


def test_error_feedback_shrinks_accumulated_error():
    n, steps = 4096, 40
    x = gaussian(n, COMM.rank, seed=7) * np.float32(1e-3)
    counts = [len(c) for c in np.array_split(np.arange(n), P)]
    want = rs_reference(n, "sum", counts, seed=7) * 1e-3 * steps
    errs = {}
    for spec in ("fp8-e4m3", "ef+fp8-e4m3"):
        codec = get(spec)
        acc = np.zeros(counts[COMM.rank])
        for _ in range(steps):
            acc += compressed_reduce_scatter(COMM, x, "sum", codec=codec, name="ef-rs")
        errs[spec] = rel_err(acc, want)
    if P > 1:
        assert errs["ef+fp8-e4m3"] < 0.25 * errs["fp8-e4m3"], errs
        # the residual covers the whole tensor (this rank sends every chunk but its own)
        assert codec.stages[0].residual(("ef-rs", "rs")).shape == (n,)


def test_async_matches_blocking():
    x = gaussian(20_000, COMM.rank, seed=5)
    h1 = cw.reduce_scatter_async(x, "avg", codec="fp8-e4m3", name="rs-async")
    h2 = cw.allgather_async(x[:100], codec="nvfp4", name="ag-async")
    np.testing.assert_array_equal(h1.wait(), cw.reduce_scatter(x, "avg", codec="fp8-e4m3", name="rs-async"))
    np.testing.assert_array_equal(h2.wait(), cw.allgather(x[:100], codec="nvfp4", name="ag-async"))


def test_bad_input_raises_on_every_rank():
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="transforms whole weight matrices"):
        cw.reduce_scatter(x, codec="gift+fp8-e4m3")
    with pytest.raises(ValueError, match="error feedback compensates sums"):
        cw.allgather(x, codec="ef+fp8-e4m3")
    with pytest.raises(ValueError, match="op='max' cannot run"):
        cw.reduce_scatter(x, "max", codec="fp8-e4m3")
    with pytest.raises(TypeError, match="needs a float array"):
        cw.reduce_scatter(np.ones(8, np.int32), codec="nvfp4")
    with pytest.raises(ValueError, match="sum to"):
        cw.reduce_scatter(x, codec="fp8-e4m3", counts=[1] * P)
    # only rank 0 passes a bad argument; every rank raises, none hangs
    if P > 1:
        bad = np.ones(5, np.float32) if COMM.rank == 0 else x
        with pytest.raises(Exception, match="shape|agree|differ"):
            cw.reduce_scatter(bad, codec="fp8-e4m3", name="rs-mismatch")
    with pytest.raises(ValueError, match="needs counts="):
        compressed_allgather(COMM, x, codec="fp8-e4m3", out=np.empty(8 * P, np.float32))
    # the collectives still work afterwards
    np.testing.assert_allclose(cw.reduce_scatter(np.ones(2 * P, np.float32), codec="fp8-e4m3", name="after"),
                               np.full(2, float(P)))


def test_non_finite_stays_visible():
    x = gaussian(1000, COMM.rank)
    if COMM.rank == 0:
        x[:] = np.nan
    got = cw.reduce_scatter(x, codec="fp8-e4m3", name="rs-nan")
    assert not np.isfinite(got).any()


def test_collective_path_matches_point_to_point():
    # NCCL sends no point-to-point messages the pipeline can use: there the chunks travel by one
    # all-to-all. Forced here on this transport, the results must be bit-identical.
    from commwire.codecs.collective import _pipe

    x = gaussian(3000, COMM.rank, seed=9)
    p2p = cw.reduce_scatter(x, "avg", codec="ef+nvfp4", name="rs-path-a")
    pipe = _pipe(COMM)
    saved = pipe.point_to_point
    pipe.point_to_point = False
    try:
        collective = cw.reduce_scatter(x, "avg", codec="ef+nvfp4", name="rs-path-b")
    finally:
        pipe.point_to_point = saved
    np.testing.assert_array_equal(collective, p2p)


@pytest.mark.parametrize("which", ["reduce_scatter", "allgather"])
def test_later_calls_carry_the_agreement_flag_in_the_payload(which):
    # After the first call of a name is agreed, later calls carry each rank's "my arguments deviate"
    # flag in their own messages: no separate flag exchange, and a deviation still reaches every rank.
    if COMM.check != "first":
        pytest.skip("the flag is only used after a first call's agreement (check='first')")
    call = (lambda a: cw.reduce_scatter(a, "sum", codec="fp8-e4m3", name=f"flag-{which}")) \
        if which == "reduce_scatter" else (lambda a: cw.allgather(a, codec="fp8-e4m3", name=f"flag-{which}"))
    x = gaussian(4 * P, COMM.rank, seed=12)
    first = call(x)

    def no_flag_exchange(*args):
        raise AssertionError("a separate flag exchange ran")

    COMM._flag_start = no_flag_exchange  # an instance attribute over the protocol's method
    try:
        np.testing.assert_array_equal(call(x), first)
    finally:
        del COMM._flag_start
    if P > 1:
        # reduce-scatter: another length; all-gather (rows may differ): another row shape
        other = gaussian(4 * P + 2, COMM.rank) if which == "reduce_scatter" else x.reshape(-1, 2)
        bad = other if COMM.rank == P - 1 else x
        with pytest.raises(Exception, match="shape|agree|differ"):
            call(bad)
    # every rank changing shape together is a new agreed shape: redone, right
    y = gaussian(8 * P, COMM.rank, seed=13)
    got = call(y)
    if which == "reduce_scatter":
        want = rs_reference(8 * P, "sum", [8] * P, seed=13)
    else:
        want = np.concatenate([gaussian(8 * P, r, seed=13) for r in range(P)]).astype(np.float64)
    assert rel_err(got, want) < 0.04
    np.testing.assert_array_equal(call(x), first)
