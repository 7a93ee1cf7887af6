"""Every name of ``horovod.torch`` in commwire.torch, against references computed here — tier 2.

Run by tests/torch/test_horovod.py as ``mpiexec -n {1,2,4} python -m pytest``
on this file. Each rank's input is a deterministic function of (rank, case),
so each rank computes the expected result of every collective itself, in
float64 (or exactly, for integers and data moves). Tolerances: float16 1e-3
relative (one rounding of a float32 sum), float32 1e-6, float64 1e-12;
Adasum against a float64 re-implementation of the pairwise formula over the
binary tree of ranks, 1e-5.

Semantics checked are Horovod's (read from its documentation and test suite):
integer averages truncate, scaling happens before/after the sum, ``root_rank``
is a global rank, grouped collectives fuse, joined ranks count as zeros.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

import commwire
import commwire.torch as hvd

hvd.init()
R, P = hvd.rank(), hvd.size()
TOL = {torch.float16: 1e-3, torch.float32: 1e-6, torch.float64: 1e-12}


def value(rank: int, shape: tuple[int, ...], dtype: torch.dtype, case: int = 0) -> torch.Tensor:
    """Return rank's input: small integers, so sums are exact in every dtype."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    low = 0 if dtype in (torch.uint8, torch.bool) else -8
    return torch.randint(low, 9, shape, generator=g).to(dtype)


def everyone(shape, dtype, case=0) -> torch.Tensor:
    return torch.stack([value(r, shape, torch.float64, case) for r in range(P)])


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    tol = TOL.get(got.dtype, 0)
    np.testing.assert_allclose(got.double().numpy(), want.double().numpy(), rtol=tol, atol=tol)


DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
          torch.float64]


# ------------------------------------------------------------------ introspection and lifecycle
def test_introspection():
    assert hvd.is_initialized() and hvd.size() == commwire.size() and hvd.rank() == commwire.rank()
    assert 0 <= hvd.local_rank() < hvd.local_size() and hvd.cross_size() * hvd.local_size() == P
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built() and not hvd.gloo_enabled()
    assert hvd.nccl_built() == 0 and not hvd.ccl_built() and not hvd.ddl_built() and not hvd.rocm_built()
    assert hvd.cuda_built() == torch.cuda.is_available()
    assert hvd.mpi_threads_supported() and hvd.is_homogeneous()
    assert {hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product, hvd.Adasum} == {
        "sum", "avg", "min", "max", "prod", "adasum"}
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.global_process_set.process_set_id == 0 and hvd.global_process_set.ranks == list(range(P))


def test_shutdown_and_init_again():
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match="hvd.init"):
        hvd.allreduce(torch.ones(1))
    hvd.init()
    assert hvd.is_initialized()
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(P)))


# ------------------------------------------------------------------ allreduce
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "prod"])
def test_allreduce_ops_and_dtypes(dtype, op):
    if op == "prod" and dtype in (torch.int8, torch.uint8):
        return  # products of small ints overflow one byte
    x = value(R, (3, 4), dtype)
    all_x = torch.stack([value(r, (3, 4), dtype).double() for r in range(P)])
    want = {"sum": all_x.sum(0), "min": all_x.min(0).values, "max": all_x.max(0).values,
            "prod": all_x.prod(0), "avg": all_x.mean(0)}[op]
    if op == "avg" and not dtype.is_floating_point:
        want = torch.trunc(all_x.sum(0) / P)  # Horovod: integer averages truncate toward zero
    if op in ("sum", "prod") and dtype in (torch.int8, torch.uint8, torch.int16):
        want = want.to(torch.int64).to(dtype).double()  # wraps like the dtype
    got = hvd.allreduce(x, op=op)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, want.to(torch.float64))


def test_allreduce_average_flag_and_positional_order():
    x = value(R, (5,), torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        close(hvd.allreduce(x, False), everyone((5,), None).sum(0))  # Horovod: (tensor, average, name, ...)
        close(hvd.allreduce(x, True), everyone((5,), None).mean(0))
        with pytest.raises(ValueError, match="supersedes"):
            hvd.allreduce(x, average=True, op=hvd.Sum)
    close(hvd.allreduce(x), everyone((5,), None).mean(0))  # default: Average


@pytest.mark.parametrize("dtype", [torch.int32, torch.float16, torch.float32, torch.float64])
def test_allreduce_prescale_postscale(dtype):
    x = value(R, (6,), dtype)
    pre, post = 0.375, 1.5  # exact in every float dtype
    scale = (lambda t: (t.double() * pre).to(dtype)) if not dtype.is_floating_point else (lambda t: t * pre)
    want = sum(scale(value(r, (6,), dtype)).double() for r in range(P)) * post
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=pre, postscale_factor=post)
    want = want.to(dtype) if not dtype.is_floating_point else want
    close(got, want.double())


def test_allreduce_async_inplace_and_poll():
    xs = [value(R, (4, 3), torch.float32, case=i) for i in range(6)]
    handles = [hvd.allreduce_async(x, op=hvd.Sum, name=f"async.{i}") for i, x in enumerate(xs)]
    assert not all(hvd.poll(h) for h in handles) or P == 1  # asynchronous: some still running
    for i, h in enumerate(handles):
        close(hvd.synchronize(h), everyone((4, 3), None, case=i).sum(0))
    y = value(R, (7,), torch.float64)
    h = hvd.allreduce_async_(y, op=hvd.Max, name="inplace")
    assert hvd.synchronize(h) is y
    close(y, everyone((7,), None).max(0).values)
    z = value(R, (2, 2), torch.int64)
    assert hvd.allreduce_(z, op=hvd.Sum) is z
    close(z, everyone((2, 2), None).sum(0))


def test_duplicate_name_in_flight_is_refused_locally():
    if P == 1:
        return
    h = hvd.allreduce_async(torch.ones(3), name="twice") if R == 0 else None
    if R == 0:
        with pytest.raises(ValueError, match="still in flight"):
            hvd.allreduce_async(torch.ones(3), name="twice")
    hvd.barrier()
    if R > 0:
        h = hvd.allreduce_async(torch.ones(3), name="twice")
    close(hvd.synchronize(h), torch.ones(3))


def test_allreduce_gradients():
    for op, factor in ((hvd.Sum, P), (hvd.Average, 1)):
        x = value(R, (3, 2), torch.float64).requires_grad_()
        y = hvd.allreduce(x, op=op)
        (y * torch.arange(6.0, dtype=torch.float64).view(3, 2)).sum().backward()
        close(x.grad, torch.arange(6.0, dtype=torch.float64).view(3, 2) * factor)


def test_allreduce_adasum_matches_a_float64_reference():
    if P & (P - 1):
        with pytest.raises(NotImplementedError):
            hvd.allreduce(torch.ones(4), op=hvd.Adasum)
        return
    x = value(R, (33,), torch.float64, case=7) + R

    def pair(a, b):
        dot = float(a @ b)
        na, nb = float(a @ a), float(b @ b)
        ca = 1 - dot / (2 * na) if na else 1.0
        cb = 1 - dot / (2 * nb) if nb else 1.0
        return ca * a + cb * b

    level = [value(r, (33,), torch.float64, case=7) + r for r in range(P)]
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Adasum).numpy(), level[0].numpy(), rtol=1e-5)


def test_allreduce_with_compressors():
    x = value(R, (64,), torch.float32)
    close(hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16), everyone((64,), None).sum(0))
    got = hvd.allreduce(x * 0.01, op=hvd.Average, compression=hvd.Compression.fp8, name="fp8")
    want = everyone((64,), None).mean(0) * 0.01
    assert float((got.double() - want).abs().max()) <= 0.13 * float(want.abs().max())  # two E4M3 roundings

    class Halve(hvd.Compressor):  # a user-written Compressor: must be applied around the sum
        @staticmethod
        def compress(t):
            return t * 0.5, "ctx"

        @staticmethod
        def decompress(t, ctx):
            assert ctx == "ctx"
            return t * 2

    close(hvd.allreduce(x, op=hvd.Sum, compression=Halve), everyone((64,), None).sum(0))


def test_compression_fp16_roundtrip():
    for dtype in (torch.float32, torch.float64):
        sent, ctx = hvd.Compression.fp16.compress(torch.ones(3, dtype=dtype))
        assert sent.dtype == torch.float16 and hvd.Compression.fp16.decompress(sent, ctx).dtype == dtype
    sent, ctx = hvd.Compression.fp16.compress(torch.ones(3, dtype=torch.int16))
    assert sent.dtype == torch.int16
    assert hvd.Compression.none.compress(torch.ones(1))[1] is None


# ------------------------------------------------------------------ grouped
def test_grouped_allreduce_fuses_into_one_collective_per_dtype():
    # float32: 2-D tensors and a 1-D one (packed by flatten); int64: 1-D only (packed by cat, split back)
    xs = [value(R, (i + 1, 3), torch.float32, case=i) for i in range(5)] + [value(R, (4,), torch.int64, case=9),
                                                                            value(R, (5,), torch.float32, case=7)]
    commwire.stats(reset=True)
    got = hvd.grouped_allreduce(xs, op=hvd.Sum)
    calls = commwire.stats()["allreduce"]["calls"]
    assert calls == 2, calls  # one per dtype
    for i in range(5):
        close(got[i], everyone((i + 1, 3), None, case=i).sum(0))
    close(got[5], everyone((4,), None, case=9).sum(0))
    close(got[6], everyone((5,), None, case=7).sum(0))
    assert [g.shape for g in got] == [x.shape for x in xs] and hvd.grouped_allreduce([]) == []
    ys = [value(R, (3,), torch.float64, case=i) for i in range(3)]
    assert hvd.grouped_allreduce_(ys, op=hvd.Average) is not None
    for i, y in enumerate(ys):
        close(y, everyone((3,), None, case=i).mean(0))
    h = hvd.grouped_allreduce_async([torch.ones(2), torch.ones(3)], op=hvd.Sum)
    assert [t.tolist() for t in hvd.synchronize(h)] == [[float(P)] * 2, [float(P)] * 3]
    zs = [torch.ones(2)]
    assert hvd.synchronize(hvd.grouped_allreduce_async_(zs, op=hvd.Sum))[0] is zs[0]


def test_grouped_allreduce_gradients():
    xs = [value(R, (2,), torch.float64, case=i).requires_grad_() for i in range(3)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    sum(o.sum() for o in outs).backward()
    for x in xs:
        close(x.grad, torch.full((2,), float(P), dtype=torch.float64))


# ------------------------------------------------------------------ allgather, broadcast
@pytest.mark.parametrize("dtype", DTYPES + [torch.bool])
def test_allgather_variable_rows(dtype):
    x = torch.full((R + 1, 2), R % 2 if dtype == torch.bool else R).to(dtype)
    got = hvd.allgather(x)
    want = torch.cat([torch.full((r + 1, 2), r % 2 if dtype == torch.bool else r).to(dtype) for r in range(P)])
    assert torch.equal(got, want)
    h = hvd.allgather_async(x)
    assert torch.equal(hvd.synchronize(h), want)


def test_allgather_gradient_is_the_averaged_rows_of_this_rank():
    x = torch.full((R + 1, 2), float(R), dtype=torch.float64, requires_grad=True)
    gathered = hvd.allgather(x)
    weight = torch.cat([torch.full((r + 1, 2), float(r + 1), dtype=torch.float64) for r in range(P)])
    (gathered * weight).sum().backward()
    close(x.grad, torch.full((R + 1, 2), float(R + 1), dtype=torch.float64))


def test_grouped_allgather_fused():
    xs = [torch.full((R + 1,), R, dtype=torch.int16), torch.full((2, 3), float(R))]
    got = hvd.grouped_allgather(xs)
    assert torch.equal(got[0], torch.cat([torch.full((r + 1,), r, dtype=torch.int16) for r in range(P)]))
    assert torch.equal(got[1], torch.cat([torch.full((2, 3), float(r)) for r in range(P)]))
    h = hvd.grouped_allgather_async(xs)
    assert torch.equal(hvd.synchronize(h)[1], got[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_every_root(dtype):
    for root in range(P):
        x = value(R, (3, 2), dtype)
        want = value(root, (3, 2), dtype)
        before = x.clone()
        assert torch.equal(hvd.broadcast(x, root), want)
        assert torch.equal(x, before)  # not modified
        assert hvd.broadcast_(x, root) is x and torch.equal(x, want)
        y = value(R, (2,), dtype)
        assert torch.equal(hvd.synchronize(hvd.broadcast_async(y, root)), value(root, (2,), dtype))
        assert hvd.synchronize(hvd.broadcast_async_(y, root)) is y


def test_broadcast_gradient_reaches_the_root_only():
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    hvd.broadcast(x, P - 1).sum().backward()
    close(x.grad, torch.full((3,), 1.0 if R == P - 1 else 0.0, dtype=torch.float64))


def test_broadcast_root_outside_the_process_set_raises_on_every_rank():
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.ones(2), P + 3)


def test_objects():
    assert hvd.broadcast_object({"r": R, 0: [1, 2]} if R == 0 else None, 0) == {"r": 0, 0: [1, 2]}
    assert hvd.allgather_object({"r": R}) == [{"r": r} for r in range(P)]


def test_broadcast_parameters_and_optimizer_state_like_horovod():
    torch.manual_seed(R)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (R + 1), betas=(0.8 + 0.01 * R, 0.99))
    if R == 0:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    gathered = hvd.allgather_object({k: v.tolist() for k, v in model.state_dict().items()})
    assert all(g == gathered[0] for g in gathered)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01) and opt.param_groups[0]["betas"] == (0.8, 0.99)
    states = hvd.allgather_object({k: [t.tolist() if torch.is_tensor(t) else t for t in v.values()]
                                   for k, v in opt.state_dict()["state"].items()})
    assert all(s == states[0] for s in states) and len(states[0]) == 4


def test_broadcast_optimizer_state_initialises_a_fresh_optimizer():
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state_dict()["state"]) == 2 and all(p.grad is not None for p in model.parameters())


# ------------------------------------------------------------------ alltoall, reducescatter
def test_alltoall_equal_and_uneven():
    x = torch.arange(P * 2, dtype=torch.float32) + 100 * R
    got = hvd.alltoall(x)
    assert torch.equal(got, torch.cat([torch.arange(2 * R, 2 * R + 2, dtype=torch.float32) + 100 * r
                                       for r in range(P)]))
    rows = torch.cat([torch.full((R + 1, 2), float(dest)) for dest in range(P)])
    got, received = hvd.alltoall(rows, splits=torch.tensor([R + 1] * P, dtype=torch.int32))
    assert received.tolist() == [r + 1 for r in range(P)] and received.dtype == torch.int32
    assert torch.equal(got, torch.full((P * (P + 1) // 2, 2), float(R)))
    out, rec = hvd.synchronize(hvd.alltoall_async(rows, splits=[R + 1] * P))
    assert torch.equal(out, got) and rec.tolist() == received.tolist()
    with pytest.raises(ValueError, match="integers"):
        hvd.alltoall(torch.ones(P), splits=torch.ones(P))


def test_alltoall_gradient():
    x = torch.ones(P * (R + 1), dtype=torch.float64, requires_grad=True)
    out, _ = hvd.alltoall(x, splits=[R + 1] * P)
    (out * 3).sum().backward()
    close(x.grad, torch.full((P * (R + 1),), 3.0, dtype=torch.float64))


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("rows", [P * 2, P * 2 + 1])
def test_reducescatter_and_grouped(op, rows):
    xs = [value(R, (rows, 3), torch.float32, case=i) for i in range(3)]
    blocks = np.array_split(np.arange(rows), P)[R]
    want = [(everyone((rows, 3), None, case=i).sum(0) if op == "sum" else everyone((rows, 3), None, case=i)
             .mean(0))[blocks[0]:blocks[-1] + 1] if len(blocks) else None for i in range(3)]
    close(hvd.reducescatter(xs[0], op=op), want[0])
    close(hvd.synchronize(hvd.reducescatter_async(xs[0], op=op)), want[0])
    commwire.stats(reset=True)
    grouped = hvd.grouped_reducescatter(xs, op=op)
    assert commwire.stats()["reduce_scatter"]["calls"] == 1  # fused
    for g, w in zip(grouped, want):
        close(g, w)
    assert len(hvd.synchronize(hvd.grouped_reducescatter_async(xs, op=op))) == 3


def test_reducescatter_gradient_and_errors():
    x = torch.ones(P * 2, 2, dtype=torch.float64, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()
    close(x.grad, torch.full((P * 2, 2), float(P), dtype=torch.float64))
    with pytest.raises(ValueError, match="scalar"):
        hvd.reducescatter(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="adasum"):
        hvd.reducescatter(torch.ones(P), op=hvd.Adasum)


@pytest.mark.parametrize("compression", ["ef+fp8-e4m3", "fp16-compressor", "nvfp4"])
def test_reducescatter_and_allgather_with_compression(compression):
    comp = hvd.Compression.fp16 if compression == "fp16-compressor" else compression
    bound = {"ef+fp8-e4m3": 0.04, "fp16-compressor": 1e-3, "nvfp4": 0.15}[compression]
    g = torch.Generator().manual_seed(50 + R)
    x = torch.randn(P * 40 + 1, 8, generator=g)
    full = torch.stack([torch.randn(P * 40 + 1, 8, generator=torch.Generator().manual_seed(50 + r))
                        for r in range(P)]).double()
    rows = np.array_split(np.arange(P * 40 + 1), P)[R]
    want = full.mean(0)[rows[0]:rows[-1] + 1]

    def rel(got, ref):
        return float((got.double() - ref).norm() / ref.norm())

    got = hvd.reducescatter(x, op=hvd.Average, compression=comp, name=f"rs.{compression}")
    assert got.dtype == x.dtype and tuple(got.shape) == (len(rows), 8) and rel(got, want) < bound
    got_async = hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Average, compression=comp,
                                                        name=f"rs.{compression}"))
    assert rel(got_async, want) < bound
    grouped = hvd.grouped_reducescatter([x, 2 * x], op=hvd.Average, compression=comp, name=f"grs.{compression}")
    assert rel(grouped[0], want) < bound and rel(grouped[1], 2 * want) < bound
    shard = x[: R + 1]  # uneven rows
    gathered = hvd.allgather(shard, compression=comp if compression != "ef+fp8-e4m3" else "fp8-e4m3")
    ref = torch.cat([full[r, : r + 1] for r in range(P)])
    assert tuple(gathered.shape) == tuple(ref.shape) and rel(gathered, ref) < bound
    pieces = hvd.grouped_allgather([shard, shard * 3], compression="nvfp4" if compression == "nvfp4" else "fp8-e4m3")
    assert rel(pieces[1], 3 * ref) < 0.15
    if compression == "ef+fp8-e4m3":
        with pytest.raises(ValueError, match="error feedback compensates sums"):
            hvd.allgather(shard, compression="ef+fp8-e4m3")


def test_sparse_allreduce_async():
    dense = torch.zeros(6, 2)
    dense[R % 6] = R + 1.0
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse", op=hvd.Sum)
    want = torch.zeros(6, 2)
    for r in range(P):
        want[r % 6] += r + 1.0
    assert torch.equal(hvd.synchronize(handle).to_dense(), want)


# ------------------------------------------------------------------ process sets, join, barrier
def test_process_sets():
    evens, odds = list(range(0, P, 2)), list(range(1, P, 2))
    if P == 1:  # the only set of one rank is the global one
        with pytest.raises(ValueError, match="duplicate"):
            hvd.add_process_set(evens)
        return
    even = hvd.add_process_set(evens)
    odd = hvd.add_process_set(odds) if odds else None
    mine = even if R % 2 == 0 else odd
    assert mine.included() and mine.size() == len(mine.ranks) and mine.rank() == mine.ranks.index(R)
    got = hvd.allreduce(torch.full((2,), float(R)), op=hvd.Sum, process_set=mine)
    close(got, torch.full((2,), float(sum(mine.ranks))))
    assert torch.equal(hvd.broadcast(torch.full((1,), float(R)), mine.ranks[-1], process_set=mine),
                       torch.full((1,), float(mine.ranks[-1])))
    assert hvd.allgather(torch.full((1,), R), process_set=mine).tolist() == mine.ranks
    hvd.barrier(process_set=mine)
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(evens)
    if odd is not None:
        other = odd if mine is even else even
        with pytest.raises(ValueError, match="not a member"):
            hvd.allreduce(torch.ones(1), process_set=other)
        assert hvd.remove_process_set(odd)
    assert hvd.remove_process_set(even) and not hvd.remove_process_set(even)


def test_init_registers_process_sets_as_horovod():
    """hvd.init(process_sets=...) by Horovod's rules (its test_process_sets_static / _multi_comm)."""
    from mpi4py import MPI

    hvd.shutdown()
    split = MPI.COMM_WORLD.Split(R % 2, R)
    try:
        check_init_registers_process_sets(hvd.ProcessSet(split))
    finally:
        hvd.shutdown()
        split.Free()
        hvd.init()


def check_init_registers_process_sets(halves):
    from mpi4py import MPI

    evens, odds = list(range(0, P, 2)), list(range(1, P, 2))
    if P == 1:  # the split is the whole world: a duplicate of the global set
        with pytest.raises(ValueError, match=r"entry 0 \(a communicator over ranks \[0\]\) repeats the global"):
            hvd.init(comm=MPI.COMM_WORLD, process_sets=[halves])
        assert hvd.is_initialized() and halves.process_set_id is None
        return
    hvd.init(comm=MPI.COMM_WORLD, process_sets=[halves])
    assert hvd.global_process_set.mpi_comm is MPI.COMM_WORLD and hvd.global_process_set.process_set_id == 0
    # both halves are registered on every rank (evens first); this rank's object is its own half
    assert halves.process_set_id == (1 if R % 2 == 0 else 2) and halves.ranks == (evens if R % 2 == 0 else odds)
    assert halves.size() == len(halves.ranks) and halves.rank() == halves.ranks.index(R)
    got = hvd.allreduce(torch.full((3,), R + 1.0), op=hvd.Sum, process_set=halves)
    close(got, torch.full((3,), float(sum(r + 1 for r in halves.ranks))))

    # init again: sets registered already are bound, not refused; the other half is no set of this rank
    mine, other = hvd.ProcessSet(halves.ranks), hvd.ProcessSet(odds if R % 2 == 0 else evens)
    hvd.init(process_sets=[other, mine])
    assert (mine.process_set_id, other.process_set_id) == ((1, 2) if R % 2 == 0 else (2, 1))
    assert other.included() is False and other.rank() is None
    with pytest.raises(ValueError, match="not a member"):
        hvd.allreduce(torch.ones(1), process_set=other)
    with pytest.raises(ValueError, match=r"duplicate process set: ranks \[0"):
        hvd.add_process_set(evens)

    # a duplicate inside one list: the rest is registered, the duplicate invalidated, every rank told
    first, again = hvd.ProcessSet([0, P - 1]), hvd.ProcessSet([P - 1, 0])
    dup = "repeats the global process set" if P == 2 else "repeats entry 0"
    with pytest.raises(ValueError, match=rf"entry 1 \(ranks \[0, {P - 1}\]\) {dup}"):
        hvd.init(process_sets=[first, again])
    assert again.process_set_id is None and (first.process_set_id is None) == (P == 2)
    if P > 2 and R in (0, P - 1):
        close(hvd.allreduce(torch.full((1,), R + 1.0), op=hvd.Sum, process_set=first), torch.full((1,), P + 1.0))

    # lists that differ between ranks register nothing, and every rank says so
    with pytest.raises(ValueError, match=r"number of communicator sets differs between ranks \{0: 1, 1: 0"):
        hvd.init(process_sets=[hvd.ProcessSet(MPI.COMM_WORLD)] if R == 0 else [])
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(P)))

    # removing a set invalidates every object that stands for it
    assert hvd.remove_process_set(mine) and halves.process_set_id is None and mine.process_set_id is None
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=halves)


def test_process_set_arguments():
    for bad in ([0.5], ["0"], 3):
        with pytest.raises(ValueError, match="list of integer ranks or an mpi4py communicator"):
            hvd.ProcessSet(bad)
    with pytest.raises(ValueError, match="distinct ranks"):
        hvd.ProcessSet([0, 0])
    assert hvd.ProcessSet([np.int64(P - 1), *range(P - 1)]).ranks == list(range(P))
    with pytest.raises(ValueError, match="list of hvd.ProcessSet"):
        hvd.init(process_sets=hvd.ProcessSet([0]))
    from mpi4py import MPI

    # one rank's communicator is no communicator of its own: every rank raises, none waits
    split = MPI.COMM_WORLD.Split(R % 2, R)
    with pytest.raises(ValueError, match=r"communicator set 0 on rank 0 is not a communicator over world ranks"):
        hvd.init(process_sets=[hvd.ProcessSet(MPI.COMM_NULL if R == 0 else split)])
    split.Free()
    close(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(P)))


def test_distributed_optimizer_on_a_process_set():
    if P < 2:
        return
    evens = hvd.add_process_set(list(range(0, P, 2)))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=evens)
    torch.manual_seed(100 + R)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    weights = hvd.allgather_object(model.weight.detach().tolist())
    assert all(weights[r] == weights[0] for r in evens.ranks)
    if P > 1:
        assert weights[1] != weights[0]  # rank 1 is no member: stepped alone
    hvd.remove_process_set(evens)


def test_join_counts_joined_ranks_as_zeros():
    for first in range(P):
        if R == first:
            last = hvd.join()
        else:
            got = hvd.allreduce(torch.full((3,), float(R + 1)), op=hvd.Sum, name="join.sum")
            close(got, torch.full((3,), float(sum(r + 1 for r in range(P) if r != first))))
            if P > 1:
                with pytest.raises(RuntimeError, match="join"):
                    hvd.allgather(torch.ones(1))
            last = hvd.join()
        assert hvd.allgather_object(last) == [last] * P
        assert last != first or P == 1


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64])
def test_join_while_other_ranks_reduce_asynchronously(dtype):
    # The joined rank moves zeros from its own thread while the others' all-reduces run on
    # their lanes' threads: both sides must use the same (non-blocking) MPI collective.
    for first in range(P):
        a, b = value(R, (5,), dtype, case=first), value(R, (17, 3), dtype, case=first + 10)
        if R == first:
            last = hvd.join()
        else:
            ha = hvd.allreduce_async(a, op=hvd.Average, name="join.a")
            hb = hvd.allreduce_async(b, op=hvd.Average, name="join.b")
            got_a, got_b = hvd.synchronize(ha), hvd.synchronize(hb)
            for got, shape, case in ((got_a, (5,), first), (got_b, (17, 3), first + 10)):
                total = sum(value(r, shape, dtype, case).double() for r in range(P) if r != first)
                want = torch.div(total, P, rounding_mode="trunc") if not dtype.is_floating_point else total / P
                close(got, want.to(dtype))
            last = hvd.join()
        assert hvd.allgather_object(last) == [last] * P
        assert last != first or P == 1


# ------------------------------------------------------------------ init() as a synchronisation point
@pytest.mark.parametrize("behind", ["blocking", "async", "ahead"])
def test_init_brings_ranks_a_failure_left_apart_back_in_step(behind):
    # Rank P-1 runs two more collectives than the others (as after an assertion that failed on the
    # others only): each raises there, naming the waiting ranks, and nothing pairs with the next
    # work. "ahead": the others are the ones still running collectives while rank P-1 waits.
    if P == 1:
        pytest.skip("needs two ranks")
    odd = (R == P - 1) != (behind == "ahead")
    if odd:
        for i in range(2):
            with pytest.raises(commwire.CollectiveMismatchError,
                               match=r"wait in resync \(commwire.torch.init\(\) called again\) for every rank"):
                if behind == "async":
                    hvd.synchronize(hvd.allreduce_async(torch.ones(4), name=f"behind.{i}"))
                else:
                    hvd.allreduce(torch.ones(4), name=f"behind.{i}")
    hvd.init()
    got = hvd.allreduce(torch.full((3,), float(R + 1)), op=hvd.Sum, name="after.init")
    close(got, torch.full((3,), float(P * (P + 1) // 2)))
    got = hvd.synchronize(hvd.allreduce_async(torch.full((2,), float(R)), op=hvd.Sum, name="after.init.async"))
    close(got, torch.full((2,), float(P * (P - 1) // 2)))


def test_barrier_pairs_with_ranks_waiting_in_init():
    if P == 1:
        pytest.skip("needs two ranks")
    if R == 0:
        with pytest.raises(commwire.CollectiveMismatchError,
                           match=r"wait in resync(.|\n)*rank 0: collective 'barrier'"):
            hvd.barrier()
    hvd.init()
    hvd.barrier()
    assert hvd.allgather_object(R) == list(range(P))


# ------------------------------------------------------------------ DistributedOptimizer
def _fit(opt_factory, steps=3, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = hvd.DistributedOptimizer(opt_factory(model.parameters()), named_parameters=model.named_parameters(),
                                   **kwargs)
    for step in range(steps):
        torch.manual_seed(10 * step + R)
        opt.zero_grad()
        model(torch.randn(8, 5)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _reference(opt_factory, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = opt_factory(model.parameters())
    for step in range(steps):
        opt.zero_grad()
        for r in range(P):  # the average of every rank's gradient, in one process
            torch.manual_seed(10 * step + r)
            (model(torch.randn(8, 5)).pow(2).mean() / P).backward()
        opt.step()
    return model


@pytest.mark.parametrize("kwargs", [{}, {"groups": 2}, {"compression": hvd.Compression.fp16},
                                    {"gradient_predivide_factor": 2.0}])
def test_distributed_optimizer_equals_single_process_training(kwargs):
    make = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    model, _ = _fit(make, **kwargs)
    ref = _reference(make)
    tol = 2e-3 if "compression" in kwargs else 1e-5
    for a, b in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=tol, atol=tol)


def test_distributed_optimizer_user_compressor_and_explicit_groups():
    calls = []

    class Scale(hvd.Compressor):
        @staticmethod
        def compress(t):
            calls.append(t.numel())
            return t * 4, None

        @staticmethod
        def decompress(t, ctx):
            return t / 4

    make = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                   compression=Scale, groups=[[model[0].weight, model[2].weight]])
    for step in range(3):
        torch.manual_seed(10 * step + R)
        opt.zero_grad()
        model(torch.randn(8, 5)).pow(2).mean().backward()
        opt.step()
    assert sorted(set(calls)) == sorted({20 + 4, 4, 1})  # the group, and each bias alone
    for a, b in zip(model.parameters(), _reference(make).parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_param_groups_follow_load_state_dict():
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                   named_parameters=model.named_parameters())
    other = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    opt.load_state_dict(other.state_dict())
    assert opt.param_groups[0]["lr"] == 0.1 and opt.optimizer.param_groups[0]["lr"] == 0.1
    assert opt.param_groups is opt.optimizer.param_groups


def test_synchronize_then_step_warns_once_and_skip_synchronize_does_not():
    model = torch.nn.Linear(1, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(1, 1)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert len(caught) == 1 and "skip_synchronize" in str(caught[0].message)
    opt.zero_grad()
    model(torch.ones(1, 1)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    assert not caught
    assert set(opt._parameter_names.values()) == {"weight", "bias"}


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients(sparse_as_dense):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 2, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=sparse_as_dense)
    emb(torch.tensor([R % 6, 5])).sum().backward()
    opt.synchronize()
    grad = emb.weight.grad
    assert grad.is_sparse
    want = torch.zeros(6, 2)
    for r in range(P):
        want[r % 6] += 1 / P
        want[5] += 1 / P
    np.testing.assert_allclose(grad.to_dense().numpy(), want.numpy(), rtol=1e-6)
    with opt.skip_synchronize():
        opt.step()


def test_adasum_delta_optimizer():
    if P & (P - 1):
        return
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    start = model.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    grad = torch.zeros(1, 3)
    grad[0, R % 3] = 1.0  # orthogonal deltas when P <= 3: Adasum sums them
    model.weight.grad = grad.clone()
    opt.step()
    if P <= 2:
        want = start.clone()
        for r in range(P):
            want[0, r % 3] -= 1.0
        np.testing.assert_allclose(model.weight.detach().numpy(), want.numpy(), atol=1e-6)
    weights = hvd.allgather_object(model.weight.detach().tolist())
    assert all(w == weights[0] for w in weights)


# ------------------------------------------------------------------ timeline, environment
def test_start_and_stop_timeline(tmp_path_factory):
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("tl") / "timeline.json") if R == 0 else None, 0)
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(3), name="timed")
    hvd.stop_timeline()
    if R == 0:
        import json

        events = json.load(open(path))
        assert any(e.get("name") == "timed" for e in events)


def test_horovod_fusion_threshold_is_honoured(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "0")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert len(opt._fusion.buckets) == 4  # one per tensor
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_unsupported_horovod_variables_are_reported(monkeypatch):
    from commwire.torch import _env

    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    monkeypatch.setenv("HOROVOD_HIERACHICAL_ALLREDUCE", "1")  # misspelt
    with pytest.warns(UserWarning) as caught:
        _env.apply_at_init()
    text = str(caught[0].message)
    assert "HOROVOD_CYCLE_TIME='5'" in text and "typo" in text
    assert os.environ.get("HOROVOD_TIMELINE") is None or "HOROVOD_TIMELINE" not in text
    # every variable horovodrun's options set is known; a switch set to its off value loses nothing
    from commwire.cli import horovodrun

    for _, _, variable, _, _ in horovodrun.KNOBS:
        assert variable in _env.NO_EFFECT or variable in _env.HONOURED, variable
    monkeypatch.delenv("HOROVOD_CYCLE_TIME")
    monkeypatch.delenv("HOROVOD_HIERACHICAL_ALLREDUCE")
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "0")
    monkeypatch.setenv("HOROVOD_TORUS_ALLREDUCE", "1")
    with pytest.warns(UserWarning) as caught:
        _env.apply_at_init()
    text = str(caught[0].message)
    assert "HOROVOD_TORUS_ALLREDUCE='1': no NCCL torus" in text and "AUTOTUNE" not in text


def test_sync_batch_norm_is_exported():
    bn = hvd.SyncBatchNorm(3)
    x = torch.full((2, 3), float(R))
    out = bn(x)
    assert out.shape == (2, 3)
    np.testing.assert_allclose(bn.running_mean.numpy(), np.full(3, 0.1 * (P - 1) / 2), rtol=1e-5)
