"""Collectives on CUDA buffers — tier 3 (GPU): every collective × dtype × {CUDA-aware, staged} × {torch, cupy}.

Each rank's input is a deterministic function of (rank, case); the reference
is the float64 reduction on the host (tolerances of tests/core/mpi_collectives.py:
float64 1e-12, float32 1e-5, float16 1e-3, bfloat16 1e-2; integers and data
moves exact). Results must come back on the input's device, as its kind and
dtype. The stream tests queue slow work on a side stream right before an
asynchronous collective: MPI must see the finished values, and the caller's
stream must see the result after ``wait()`` without a host synchronisation.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _gpu import device, is_on_device, require_cupy, require_streams, size, skip_unless_cuda_aware
from mpi4py import MPI

import commwire as cw
from commwire.comm.arrays import BFLOAT16

torch = pytest.importorskip("torch")

WORLD = cw.init()
P, R = WORLD.size, WORLD.rank
DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8"]
from mpi_helpers import check_close  # noqa: E402
REFERENCE = {"sum": np.sum, "avg": np.mean, "min": np.min, "max": np.max}
_names = itertools.count()


@pytest.fixture(scope="module", params=["direct", "staged"])
def comm(request):
    if request.param == "direct":
        skip_unless_cuda_aware()
    return cw.Communicator(MPI.COMM_WORLD.Dup(), cuda_aware=request.param == "direct", uid=f"gpu-{request.param}")


@pytest.fixture(scope="module", params=["torch", "cupy"])
def kind(request):
    if request.param == "cupy":
        require_cupy()
    return request.param


def np_dtype(name: str) -> np.dtype:
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def data(rank: int, shape: tuple[int, ...], dtype: str, case: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * case + rank)
    if dtype in ("int32", "int64", "uint8"):
        return rng.integers(0, 5, size=shape).astype(dtype)
    return rng.uniform(-2, 2, size=shape).astype(np_dtype(dtype))


def on_device(a: np.ndarray, kind: str):
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(device().index):
            return cupy.asarray(a)
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device())
    return torch.from_numpy(a.copy()).to(device())


def to_host(x, kind: str) -> np.ndarray:
    if kind == "cupy":
        import cupy

        assert isinstance(x, cupy.ndarray), type(x)
        return cupy.asnumpy(x)
    assert isinstance(x, torch.Tensor) and is_on_device(x), (type(x), getattr(x, "device", None))
    x = x.cpu()
    return x.view(torch.int16).numpy().view(BFLOAT16) if x.dtype == torch.bfloat16 else x.numpy()


def skip_unsupported(kind: str, dtype: str) -> None:
    if kind == "cupy" and dtype == "bfloat16":
        pytest.skip("cupy has no bfloat16 arrays (torch's bfloat16 runs in the torch cases)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_allreduce(comm, kind, dtype, op):
    skip_unsupported(kind, dtype)
    name = f"ar.{next(_names)}"
    if op == "avg" and dtype.startswith(("int", "uint")):  # refused on the device too, on every rank
        with pytest.raises(TypeError, match="would truncate"):
            comm.allreduce(on_device(data(R, (15,), dtype), kind), op, name=name)
        return
    for n in (15, size(300_000)):  # the flag fused into the buffer / beside the data
        want = REFERENCE[op](np.stack([data(r, (n,), dtype).astype(np.float64) for r in range(P)]), axis=0)
        for _ in range(2):  # first call (exchange), then steady state
            got = comm.allreduce(on_device(data(R, (n,), dtype), kind), op, name=f"{name}.{n}")
            check_close(to_host(got, kind), want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_min_max_propagate_nan(comm, kind, dtype):
    skip_unsupported(kind, dtype)
    values = np.array([1.5, -0.25, np.inf, -np.inf, 3.0, 0.0], dtype=np.float64)
    every = np.stack([values * (r + 1) for r in range(P)])
    every[P - 1, 1] = np.nan
    for op, ref in (("min", np.minimum.reduce), ("max", np.maximum.reduce)):
        got = to_host(comm.allreduce(on_device(every[R].astype(np_dtype(dtype)), kind), op), kind).astype(float)
        want = ref(every.astype(np_dtype(dtype)).astype(np.float64), axis=0)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])


def test_in_place_and_out(comm):
    n = size(100_000)
    want = np.sum([data(r, (n,), "float32").astype(np.float64) for r in range(P)], axis=0)
    x = on_device(data(R, (n,), "float32"), "torch")
    assert comm.allreduce(x, out=x) is x
    check_close(to_host(x, "torch"), want, "float32")
    out = torch.empty(n, device=device())
    assert comm.allreduce(on_device(data(R, (n,), "float32"), "torch"), out=out) is out
    check_close(to_host(out, "torch"), want, "float32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_data_moves(comm, kind, dtype):
    skip_unsupported(kind, dtype)
    got = comm.allgather(on_device(data(R, (R + 1, 3), dtype), kind))
    np.testing.assert_array_equal(to_host(got, kind), np.concatenate([data(r, (r + 1, 3), dtype) for r in range(P)]))
    for root in range(P):
        got = comm.broadcast(on_device(data(R, (4, 2), dtype), kind), root=root)
        np.testing.assert_array_equal(to_host(got, kind), data(root, (4, 2), dtype))
    got = comm.alltoall(on_device(data(R, (2 * P, 3), dtype), kind))
    want = np.concatenate([data(r, (2 * P, 3), dtype)[2 * R:2 * R + 2] for r in range(P)])
    np.testing.assert_array_equal(to_host(got, kind), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter(comm, kind, dtype, op):
    skip_unsupported(kind, dtype)
    rows = 2 * P + 1
    full = REFERENCE[op](np.stack([data(r, (rows, 2), dtype).astype(np.float64) for r in range(P)]), axis=0)
    got = comm.reduce_scatter(on_device(data(R, (rows, 2), dtype), kind), op)
    check_close(to_host(got, kind), np.array_split(full, P)[R], dtype)


def test_async_sees_work_queued_on_a_side_stream_and_caller_sees_result(comm):
    require_streams()
    dev = device()
    n = 1 << 22
    side = torch.cuda.Stream(device=dev)
    x = torch.zeros(n, device=dev)
    torch.cuda.synchronize(dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the values exist
        x.fill_(R + 1.0)
        handle = comm.allreduce_async(x, "sum", name="stream.async")
        result = handle.wait()
        check = result * 2  # queued on the side stream right after wait(): no host sync in between
    side.synchronize()
    expected = P * (P + 1) / 2
    assert float(result[0]) == expected and float(result[-1]) == expected
    assert float(check[n // 2]) == 2 * expected
    # Blocking collectives synchronise the caller's stream before MPI reads.
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        x.fill_(R + 2.0)
        got = comm.allreduce(x, "max")
    assert float(got[n - 1]) == P + 1.0
