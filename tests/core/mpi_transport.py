"""The torch transport against the MPI transport — tier 2 (mpiexec -n 2 and 3, CPU, gloo).

Run by tests/core/test_transport.py. Reference: the same collective on the same
data over MPI in the same job (itself checked against numpy references by
mpi_collectives.py). The torch transport's conversions (integer types gloo
lacks, float min/max as ordered integers, padded uneven blocks) are exact, so
every result must be bit-identical — NaN, overflow and extremes included — and
so must the compressed all-reduce's, whose payloads gloo moves as point-to-point
messages on groups of the transport's own (one per direction and phase).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import commwire as cw
from commwire.comm import arrays
from commwire.comm.communicator import Communicator
from commwire.comm.torch_transport import init_torch_distributed

WORLD = cw.init()
init_torch_distributed(MPI.COMM_WORLD, "gloo")
TORCH = Communicator.from_process_group(dist.group.WORLD)
R, P = WORLD.rank, WORLD.size


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), (a, b)


def _close(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    tol = {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-6, "float64": 1e-14}[arrays.dtype_name(a.dtype)]
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=0, equal_nan=True)


def _data(dtype: str, n: int = 11) -> np.ndarray:
    rng = np.random.default_rng(100 + R)
    if dtype == "bool":
        return rng.random(n) < 0.5
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        x = rng.normal(size=n) * 100
        x[R % n] = np.nan  # NaN on a different element per rank
        x[(R + 3) % n] = np.inf if R % 2 else -np.inf
        return x.astype(arrays.BFLOAT16 if dtype == "bfloat16" else dtype)
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    x[0], x[1] = info.max, info.min  # sums and products wrap around
    return x


INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]


def test_the_world_and_its_process_group_agree():
    assert TORCH.transport.name == "torch" and WORLD.transport.name == "mpi"
    assert (TORCH.rank, TORCH.size) == (R, P)
    assert "over torch" in repr(TORCH)


@pytest.mark.parametrize("dtype", INTS + FLOATS + ["bool"])
@pytest.mark.parametrize("op", ["sum", "min", "max", "prod", "avg"])
def test_allreduce_is_bit_identical_to_mpi(dtype, op):
    x = _data(dtype)
    if dtype == "bool" and op not in ("min", "max") or op == "avg" and dtype not in FLOATS:
        with pytest.raises(TypeError):
            TORCH.allreduce(x, op, name=f"bad.{dtype}.{op}")
        return
    # Float sums and products over 3+ ranks depend on the order the library adds in (gloo's ring,
    # MPICH's tree): within one rounding per addition there; everything else is bit-identical.
    check = _close if dtype in FLOATS and op in ("sum", "avg", "prod") and P > 2 else _same
    check(TORCH.allreduce(x, op, name=f"{dtype}.{op}"), WORLD.allreduce(x, op, name=f"{dtype}.{op}"))
    # A second call takes the remembered signature's path (the flag in the buffer, or beside it).
    check(TORCH.allreduce(x, op, name=f"{dtype}.{op}"), WORLD.allreduce(x, op, name=f"{dtype}.{op}"))


@pytest.mark.parametrize("n", [3, 100_000])  # the flag rides in the buffer below 128 KiB, beside it above
def test_numpy_fast_path_in_place_and_out(n):
    x = np.arange(n, dtype=np.float32) * (R + 1)
    for _ in range(3):
        want = WORLD.allreduce(x, "avg", name=f"fast{n}")
        _same(TORCH.allreduce(x, "avg", name=f"fast{n}"), want)
        out = np.empty_like(x)
        assert TORCH.allreduce(x, "avg", out=out, name=f"fast{n}") is out
        _same(out, want)
        y = x.copy()
        TORCH.allreduce(y, "avg", out=y, name=f"fast{n}")
        _same(y, want)


@pytest.mark.parametrize("dtype", ["float32", "int16", "uint64", "bfloat16", "bool"])
def test_data_moves_are_bit_identical_to_mpi(dtype):
    x = _data(dtype, 4 * (R + 1)).reshape(-1, 2)  # a different number of rows per rank
    _same(TORCH.allgather(x), WORLD.allgather(x))
    b = _data(dtype, 6)
    _same(TORCH.broadcast(b, root=P - 1), WORLD.broadcast(b, root=P - 1))
    splits = [(R + r) % 3 for r in range(P)]
    rows = _data(dtype, 2 * sum(splits) + 2).reshape(-1, 2)  # rows beyond sum(splits) are not sent
    got, got_counts = TORCH.alltoallv(rows, splits)
    want, want_counts = WORLD.alltoallv(rows, splits)
    _same(got, want)
    _same(got_counts, want_counts)


@pytest.mark.parametrize("dtype", ["float32", "int16", "uint64", "float64"])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter_even_and_uneven_is_bit_identical_to_mpi(dtype, op):
    check = _close if dtype in FLOATS and op == "sum" and P > 2 else _same  # order of additions: see above
    x = _data(dtype, 3 * P * 4).reshape(3 * P, 4)
    check(TORCH.reduce_scatter(x, op), WORLD.reduce_scatter(x, op))
    counts = [r + 1 for r in range(P)]
    y = x[:sum(counts)]
    check(TORCH.reduce_scatter(y, op, counts=counts), WORLD.reduce_scatter(y, op, counts=counts))


def test_torch_tensors_and_async_handles():
    t = torch.arange(10, dtype=torch.float32) + R
    want = WORLD.allreduce(t, "sum")
    got = TORCH.allreduce_async(t, "sum").wait()
    assert torch.equal(got, want)
    handles = [TORCH.allgather_async(t[:R + 1]) for _ in range(3)] + [TORCH.broadcast_async(t, 0)]
    gathered = [h.wait() for h in handles]
    assert all(torch.equal(g, WORLD.allgather(t[:R + 1])) for g in gathered[:3])
    assert torch.equal(gathered[3], WORLD.broadcast(t, 0))


@pytest.mark.parametrize("codec", ["fp8-e4m3", "ef+fp8-e5m2", "nvfp4", "ef+nvfp4", "bf16", "hadamard+fp8-e4m3"])
@pytest.mark.parametrize("n", [1000, 300_001])  # the single all-gather; the pipeline with uneven chunks
def test_compressed_allreduce_is_bit_identical_to_mpi(codec, n):
    from commwire.codecs import get
    from commwire.codecs.collective import compressed_allreduce

    x = np.random.default_rng(7 + R).normal(size=n).astype(np.float32)
    # Codec objects of their own per transport: error-feedback residuals evolve alike on both.
    mine, theirs = get(codec), get(codec)
    for step in range(3):  # commwire adds the decoded chunks itself, in rank order: bit-identical at any size
        got = compressed_allreduce(TORCH, x * (step + 1), "avg", codec=mine, name="c", segment_bytes=64 << 10)
        want = compressed_allreduce(WORLD, x * (step + 1), "avg", codec=theirs, name="c", segment_bytes=64 << 10)
        _same(got, want)
        assert np.isfinite(got).all() and np.abs(got - x * (step + 1)).max() < np.abs(x).max() * (step + 1)
    # The tuned path (no fixed segment) as well.
    _same(compressed_allreduce(TORCH, x, codec=mine, name="tuned"),
          compressed_allreduce(WORLD, x, codec=theirs, name="tuned"))


def test_the_pipeline_sends_each_direction_and_phase_on_a_group_of_its_own(monkeypatch):
    # gloo's event loop spins while a poster holds a connection's lock (see torch_transport): the
    # codec pipeline's messages never share a connection with the data coming the other way.
    from torch.distributed import distributed_c10d as c10d

    from commwire.codecs.collective import compressed_allreduce

    comm = TORCH.duplicate()
    moves = []

    def spy(kind, real):
        def call(tensor, *, group, tag, **peer):
            moves.append((kind, group, next(iter(peer.values())), tag))
            return real(tensor, group=group, tag=tag, **peer)
        return call

    monkeypatch.setattr(dist, "isend", spy("send", dist.isend))
    monkeypatch.setattr(dist, "irecv", spy("recv", dist.irecv))
    x = np.random.default_rng(R).normal(size=50_000).astype(np.float32)
    got = compressed_allreduce(comm, x, codec="fp8-e4m3", name="routes", segment_bytes=64 << 10)
    monkeypatch.undo()
    _same(got, compressed_allreduce(WORLD, x, codec="fp8-e4m3", name="routes", segment_bytes=64 << 10))
    routes = comm.transport._routes
    assert len({id(g) for g in routes.values()}) == 4 and comm.transport.pg not in routes.values()
    assert len(moves) >= 4 * (P - 1)  # every peer, both ways, both phases
    for kind, group, peer, tag in moves:
        assert group is routes[tag % 2, R < peer if kind == "send" else peer < R], (kind, peer, tag)
    assert {(kind, tag % 2) for kind, _, _, tag in moves} == {("send", 0), ("send", 1), ("recv", 0), ("recv", 1)}
    comm.free()  # its groups go with it
    assert comm.transport._routes is None and not any(g in c10d._world.pg_map for g in routes.values())


def test_derived_communicators_stay_on_the_torch_transport():
    dup = TORCH.duplicate()
    split = TORCH.split(color=R % 2, key=-R)  # reversed order inside each part
    assert dup.transport.name == split.transport.name == "torch"
    x = np.full(4, R + 1.0)
    _same(dup.allreduce(x), WORLD.allreduce(x))
    members = [r for r in range(P) if r % 2 == R % 2][::-1]
    assert split.rank == members.index(R)
    _same(split.allgather(np.array([R])), np.array(members))
    sub = TORCH.new_group([0, P - 1])
    if R in (0, P - 1):
        _same(sub.allreduce(np.array([R])), np.array([P - 1]))
    else:
        assert sub is None


def test_a_device_array_on_a_gloo_group_is_refused_on_every_rank():
    # A CPU stand-in for a CUDA tensor (commwire.comm.arrays.cpu_standin): this group has no NCCL.
    t = torch.ones(4)
    with arrays.cpu_standin():
        with pytest.raises(TypeError, match="NCCL"):
            TORCH.allreduce(t if R == 0 else t.clone(), name="standin")
    # Every rank raised in the same collective: the next one pairs up.
    _same(TORCH.allreduce(np.ones(2), name="after"), np.full(2, float(P)))


def test_bad_transport_and_backend_are_clear_errors_on_every_rank():
    from commwire.comm import runtime

    with pytest.raises(ValueError, match="transport='gloo' is not valid"):
        cw.init(transport="gloo")
    with pytest.raises(ValueError, match="different transports"):
        runtime._make_transport(MPI.COMM_WORLD, "mpi" if R == 0 else "torch", False)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA") as info:
            init_torch_distributed(MPI.COMM_WORLD, "nccl")
        assert all(f"rank {r}:" in str(info.value) for r in range(P))  # every rank's reason, on every rank
    with pytest.raises(ValueError, match="not supported"):
        init_torch_distributed(MPI.COMM_WORLD, "ucx")


def test_from_process_group_off_its_members_is_refused():
    if P < 2:
        pytest.skip("needs a group without this rank")
    group = dist.new_group([0])
    if R != 0:
        with pytest.raises(ValueError, match="not a member"):
            Communicator.from_process_group(group)
    else:
        solo = Communicator.from_process_group(group)
        _same(solo.allreduce(np.arange(3)), np.arange(3))


def test_transports_bench_exchange_rows_time_both_transports_on_delivered_bytes():
    # The rows `commwire bench transports --exchange` prints: one per transport and size, MPI first
    # (the ratios' baseline), each a median of real exchanges whose bytes were checked on arrival.
    from commwire.bench.transports import exchange_rows

    rows = exchange_rows(WORLD, 4096, repeats=3)
    assert [r["arm"] for r in rows] == ["MPI Isend/Irecv", "torch.distributed isend/irecv (gloo)"]
    assert all(r["kind"] == "exchange" and r["bytes"] == 4096 and r["ranks"] == P for r in rows)
    assert all(0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] < 60e3 for r in rows)
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] == pytest.approx(rows[1]["median_ms"] / rows[0]["median_ms"])
