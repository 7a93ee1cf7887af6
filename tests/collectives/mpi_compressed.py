"""Compressed all-reduce on several ranks — tier 2 (run under mpiexec by test_compressed.py).

Reference: the float64 all-reduce of the same inputs. Documented bounds on the
relative L2 error of the result (two quantisations: each rank's chunk, then the
reduced chunk; Gaussian data):

| codec | bound | typical one-step round trip (formats.md) |
|---|---|---|
| fp16 | 2e-3 | ~3e-4 |
| bf16 | 1.2e-2 | ~2.3e-3 |
| fp8-e4m3 (tensor or block scales, hadamard) | 0.06 | 0.026 |
| fp8-e5m2 | 0.11 | 0.053 |
| nvfp4 | 0.2 | 0.095 |
| mxfp8-e4m3 | 0.06 | 0.029 |
| mxfp4 | 0.23 | 0.115 |
| int8 | 0.015 | 0.0065 |
| int4 | 0.2 | 0.097 |
| sign | 0.85 | 0.60 (sqrt(1 - 2/pi)) |

Every rank must end with bit-identical results.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

import commwire as cw
from commwire.codecs import get
from commwire.codecs.collective import PEER_CHOICES, TUNE_ROUNDS, compressed_allreduce, tuned_segment_bytes

torch = pytest.importorskip("torch")

COMM = cw.init()
BOUNDS = {
    "fp16": 2e-3,
    "bf16": 1.2e-2,
    "fp8-e4m3": 0.06,
    "fp8-e4m3:block=128": 0.06,
    "hadamard+fp8-e4m3": 0.06,
    "fp8-e5m2": 0.11,
    "nvfp4": 0.2,
    "ef+fp8-e4m3": 0.06,
    "mxfp8-e4m3": 0.06,
    "mxfp4": 0.23,
    "int8": 0.015,
    "int4": 0.2,
    "sign": 0.85,
}


def gaussian(n: int, rank: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed * 1000 + rank).standard_normal(n).astype(np.float32)


def reference(n: int, op: str, seed: int = 0) -> np.ndarray:
    total = np.sum([gaussian(n, r, seed).astype(np.float64) for r in range(COMM.size)], axis=0)
    return total / COMM.size if op == "avg" else total


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / max(np.linalg.norm(want), 1e-30))


def same_everywhere(arr: np.ndarray) -> bool:
    return len(set(COMM.allgather_object(zlib.crc32(np.ascontiguousarray(arr).tobytes())))) == 1


@pytest.mark.parametrize("spec", list(BOUNDS))
@pytest.mark.parametrize("n", [1, 33, 1000, 50_000])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_error_bound_and_identical_results(spec, n, op):
    x = gaussian(n, COMM.rank)
    # tiny segments and no small-message shortcut force the multi-segment pipeline
    got = compressed_allreduce(COMM, x, op, codec=spec, name=f"{spec}-{n}-{op}", segment_bytes=4096,
                               small_bytes=0 if n > 100 else 1 << 20)
    assert got.shape == x.shape and got.dtype == np.float32
    err = rel_err(got, reference(n, op))
    assert err < BOUNDS[spec], (spec, n, op, err)
    assert same_everywhere(got)


def test_small_message_variant_matches_pipelined_accuracy():
    x = gaussian(512, COMM.rank, seed=3)
    small = compressed_allreduce(COMM, x, "sum", codec="fp8-e4m3", name="s1")
    piped = compressed_allreduce(COMM, x, "sum", codec="fp8-e4m3", name="s2", small_bytes=0, segment_bytes=1024)
    want = reference(512, "sum", seed=3)
    assert rel_err(small, want) < 0.06 and rel_err(piped, want) < 0.06


@pytest.mark.parametrize("spec,per_elem", [("fp8-e4m3", 1.0), ("nvfp4", 0.5625), ("bf16", 2.0),
                                               ("mxfp4", 0.53125)])
def test_wire_bytes_per_element_in_stats(spec, per_elem):
    n = 1 << 20
    cw.stats(reset=True)
    cw.allreduce(gaussian(n, COMM.rank), codec=spec, name="bytes")
    snap = cw.stats(reset=True)
    codec = get(spec)
    row = snap["codecs"][codec.spec]
    # each of the encoded chunks carries its own scale(s): per-element cost is the
    # format's plus 4 bytes per chunk of at least min(PEER_CHOICES) (documented in collective.py)
    chunk_elems = min(PEER_CHOICES) / per_elem
    assert per_elem <= row["bytes_per_element"] < per_elem + 2 * 4 / chunk_elems + 64 * COMM.size / n + 1e-12
    assert snap["compressed_allreduce"]["input_bytes"] == 4 * n
    assert snap["compressed_allreduce"]["bytes"] < 4 * n * per_elem / 4 * 2 + 1024 * COMM.size


def test_error_feedback_shrinks_accumulated_error():
    # The same gradient all-reduced T times: without feedback the bias of each
    # quantisation accumulates linearly; with it the running sum stays close.
    n, steps = 4096, 40
    x = gaussian(n, COMM.rank, seed=7) * np.float32(1e-3)
    want = reference(n, "sum", seed=7) * 1e-3 * steps
    errs = {}
    for spec in ("fp8-e4m3", "ef+fp8-e4m3"):
        codec = get(spec)
        acc = np.zeros(n)
        for _ in range(steps):
            acc += compressed_allreduce(COMM, x, "sum", codec=codec, name="ef-test", small_bytes=0,
                                        segment_bytes=8192)
        errs[spec] = rel_err(acc, want)
    assert errs["ef+fp8-e4m3"] < 0.25 * errs["fp8-e4m3"], errs


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_torch_and_dtypes_round_trip(dtype):
    x = gaussian(3000, COMM.rank).reshape(30, 100)
    t = torch.from_numpy(x).to(getattr(torch, dtype))
    got = cw.allreduce(t, "avg", codec="fp8-e4m3", name=f"torch-{dtype}")
    assert isinstance(got, torch.Tensor) and got.dtype == t.dtype and got.shape == t.shape
    assert rel_err(got.float().numpy().reshape(-1), reference(3000, "avg")) < 0.07
    arr = x.astype(ml_dtypes.bfloat16)
    out = np.empty_like(arr)
    assert cw.allreduce(arr, "sum", codec="nvfp4", out=out, name="np-bf16") is out


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("n", [1000, 50_000])  # the single all-gather; the pipeline
def test_a_strided_out_receives_the_result(kind, n):
    x = gaussian(n, COMM.rank, seed=7)
    whole = compressed_allreduce(COMM, x, "avg", codec="fp8-e4m3", name=f"strided{n}")
    base = np.full(2 * n, -1.0, dtype=np.float32)
    out = (base if kind == "numpy" else torch.from_numpy(base))[::2]
    got = compressed_allreduce(COMM, x if kind == "numpy" else torch.from_numpy(x), "avg", codec="fp8-e4m3",
                               out=out, name=f"strided{n}")
    assert got is out
    np.testing.assert_array_equal(base[::2], whole)  # the same codec and call: the same bits
    assert (base[1::2] == -1).all()  # the elements between were left alone
    assert rel_err(whole, reference(n, "avg", seed=7)) < BOUNDS["fp8-e4m3"]


def test_async_matches_blocking():
    x = gaussian(20_000, COMM.rank, seed=5)
    h = cw.allreduce_async(x, "avg", codec=get("fp8-e4m3"), name="async")
    blocking = cw.allreduce(x, "avg", codec=get("fp8-e4m3"), name="async")
    np.testing.assert_array_equal(h.wait(), blocking)
    assert h.test() and h.done


def test_bad_input():
    with pytest.raises(ValueError, match="op='max' cannot run"):
        cw.allreduce(np.ones(8, np.float32), "max", codec="fp8-e4m3")
    with pytest.raises(TypeError, match="needs a float array"):
        cw.allreduce(np.ones(8, np.int32), codec="nvfp4")
    with pytest.raises(ValueError, match="fp8-e4m3"):
        cw.allreduce(np.ones(8, np.float32), codec="fp7")
    np.testing.assert_array_equal(cw.allreduce(np.ones(3), codec="none"), np.full(3, float(COMM.size)))


def test_non_finite_stays_visible():
    x = gaussian(1000, COMM.rank)
    if COMM.rank == 0:
        x[10] = np.inf
        x[20] = np.nan
    got = cw.allreduce(x, codec="fp8-e4m3", name="nonfinite")
    assert not np.isfinite(got).all()


def test_segment_tuner_decides_the_same_size_on_every_rank():
    n = 1_500_000  # a size no other test uses: a fresh tuner, with several candidate segments
    x = gaussian(n, COMM.rank, seed=11)
    want = reference(n, "sum", seed=11)
    calls = 0
    while tuned_segment_bytes(COMM, "nvfp4", n) is None:
        got = compressed_allreduce(COMM, x, "sum", codec="nvfp4", name="tuned", small_bytes=0)
        assert rel_err(got, want) < 0.2  # every exploring call is a correct all-reduce
        calls += 1
        assert calls <= TUNE_ROUNDS * len(PEER_CHOICES)
    chosen = tuned_segment_bytes(COMM, "nvfp4", n)
    assert len(set(COMM.mpi.allgather(chosen))) == 1 and calls >= TUNE_ROUNDS
    # afterwards the chosen segment is used: same result as a call with it fixed
    tuned = compressed_allreduce(COMM, x, "sum", codec="nvfp4", name="tuned-after", small_bytes=0)
    fixed = compressed_allreduce(COMM, x, "sum", codec="nvfp4", name="fixed", small_bytes=0, segment_bytes=chosen)
    assert np.array_equal(tuned, fixed)


def test_error_feedback_survives_the_tuner_changing_segments():
    # The tuner tries several segment sizes on the first calls of a size; the residuals
    # (one per tensor and side, sliced per chunk) must carry across those changes.
    from commwire.codecs.collective import TUNE_CALLS

    n = 200_000  # pipelined (above SMALL_BYTES), several segment candidates
    rng = np.random.default_rng(COMM.rank)
    x = rng.standard_normal(n).astype(np.float32)
    want = COMM.allreduce(x.astype(np.float64))
    codec = get("ef+fp8-e4m3")
    total = np.zeros(n)
    calls = TUNE_CALLS + 4
    for _ in range(calls):
        total += compressed_allreduce(COMM, x, codec=codec, name="ef-tuned")
    one_step = np.linalg.norm(compressed_allreduce(COMM, x, codec="fp8-e4m3", name="plain") - want)
    # with error feedback the errors cancel over calls: the mean is far closer than one step
    assert np.linalg.norm(total / calls - want) < 0.25 * one_step


def test_a_freed_communicator_releases_its_pipeline_transport():
    # The pipeline's private transport (an MPI duplicate; over gloo, four groups) is made by the
    # first pipelined call and kept by the communicator's transport, which frees it with the
    # communicator: process sets added and removed over a long job leak nothing.
    from mpi4py import MPI

    from commwire.codecs.collective import _pipe

    dup = COMM.duplicate()
    x = gaussian(200_000, COMM.rank)
    got = compressed_allreduce(dup, x, codec="fp8-e4m3", name="freed", segment_bytes=256 << 10, small_bytes=0)
    assert np.array_equal(got, compressed_allreduce(COMM, x, codec="fp8-e4m3", name="freed",
                                                    segment_bytes=256 << 10, small_bytes=0))
    pipe = _pipe(dup)
    assert pipe is _pipe(dup)  # made once
    dup.free()
    if pipe is dup.transport:  # torch: the transport itself, its groups gone
        assert pipe._routes is None
    else:
        assert pipe.mpi == MPI.COMM_NULL and dup.transport._private is None
