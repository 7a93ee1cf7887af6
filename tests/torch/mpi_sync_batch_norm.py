"""SyncBatchNorm on several ranks against torch.nn.BatchNorm on the concatenated batch — tier 2.

Run by tests/torch/test_sync_batch_norm.py as ``mpiexec -n {1,2,4} python -m
pytest`` on this file. Every rank builds every rank's batch (a deterministic
function of case and rank), runs a plain ``torch.nn.BatchNorm*d`` on their
concatenation as the reference, and compares its own slice.

The loss is ``Σ y · R`` with a fixed random ``R`` (a plain ``Σ y`` has a zero
input gradient). Input gradients are compared slice by slice; the ``weight``
and ``bias`` gradients are local in SyncBatchNorm (the optimizer reduces
them), so their sum over ranks is compared with the reference's.

Tolerances (relative and absolute): float64 1e-10 (summation order only);
float32 2e-5 on outputs, running statistics and gradients (per-rank moments
in float32, pooled in float64, against PyTorch's single-pass kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import commwire as cw
from commwire.torch.sync_batch_norm import SyncBatchNorm, _comm_for, _SyncBatchNormFunction

WORLD = cw.init()
RANK, SIZE = WORLD.rank, WORLD.size
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
REFERENCE = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}
UNEVEN = [3, 1, 0, 6]  # batch sizes of ranks 0, 1, 2, 3 (a rank with 1 sample, one with none)


@dataclass
class StandIn:
    """What SyncBatchNorm needs of a process set: ``.comm``, a commwire Communicator."""

    comm: cw.Communicator


def batch(case: int, rank: int, n: int, tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Return rank's input: shifted and scaled normal values (a mean far from 0 tests the pooling)."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    return (torch.randn((n, *tail), generator=g, dtype=torch.float64) * 3 + 5).to(dtype)


def weights(case: int, n: int, tail: tuple[int, ...], rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * case + rank + 17)
    return torch.randn((n, *tail), generator=g, dtype=torch.float64).to(dtype)


def make_pair(channels: int, dims: int, dtype: torch.dtype, process_set=None, **kw):
    """Return (SyncBatchNorm, reference BatchNorm) with the same non-trivial affine parameters."""
    sync = SyncBatchNorm(channels, process_set=process_set, **kw).to(dtype)
    ref = REFERENCE[dims](channels, **kw).to(dtype)
    if sync.affine:
        g = torch.Generator()
        with torch.no_grad():
            for m in (sync, ref):
                g.manual_seed(3)
                m.weight.copy_(torch.rand(channels, generator=g, dtype=torch.float64) + 0.5)
                m.bias.copy_(torch.randn(channels, generator=g, dtype=torch.float64))
    return sync, ref


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype], msg=lambda m: f"{what}: {m}")


def run_step(sync, ref, comm, members, case, sizes, tail, dtype):
    """Train one step on both layers and compare outputs, running statistics and gradients."""
    me = members.index(RANK)
    xs = [batch(case, r, sizes[i], tail, dtype) for i, r in enumerate(members)]
    rs = [weights(case, sizes[i], tail, r, dtype) for i, r in enumerate(members)]
    x = xs[me].clone().requires_grad_()
    y = sync(x)
    (y * rs[me]).sum().backward()
    full = torch.cat(xs).requires_grad_()
    y_ref = ref(full)
    (y_ref * torch.cat(rs)).sum().backward()
    start = sum(sizes[:me])
    rows = slice(start, start + sizes[me])
    close(y, y_ref[rows].detach(), dtype, "output")
    close(x.grad, full.grad[rows], dtype, "input gradient")
    if sync.affine:
        close(comm.allreduce(sync.weight.grad.clone(), "sum"), ref.weight.grad, dtype, "weight gradient")
        close(comm.allreduce(sync.bias.grad.clone(), "sum"), ref.bias.grad, dtype, "bias gradient")
    if sync.track_running_stats:
        close(sync.running_mean, ref.running_mean, dtype, "running_mean")
        close(sync.running_var, ref.running_var, dtype, "running_var")
        assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked)
    for m in (sync, ref):
        m.zero_grad()


def world_sizes(kind: str) -> list[int]:
    return [4] * SIZE if kind == "even" else [UNEVEN[r % len(UNEVEN)] for r in range(SIZE)]


# ------------------------------------------------------------- training
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tail", [(3,), (3, 5), (2, 3, 4)], ids=["1d", "1d-length", "2d"])
@pytest.mark.parametrize("sizes", ["even", "uneven"])
def test_training_matches_batch_norm_on_concatenation(dtype, tail, sizes):
    sync, ref = make_pair(tail[0], len(tail) + 1, dtype)
    for step in range(3):  # running statistics accumulate over steps
        run_step(sync, ref, WORLD, list(range(SIZE)), 10 * step + len(tail), world_sizes(sizes), tail, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_momentum_none_is_cumulative_average(dtype):
    sync, ref = make_pair(4, 2, dtype, momentum=None)
    for step in range(4):
        run_step(sync, ref, WORLD, list(range(SIZE)), 20 + step, world_sizes("uneven"), (4,), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", [{"affine": False}, {"track_running_stats": False},
                                     {"affine": False, "track_running_stats": False}, {"momentum": 0.5}],
                         ids=["no-affine", "no-running", "neither", "momentum"])
def test_options(dtype, options):
    sync, ref = make_pair(3, 4, dtype, **options)
    for step in range(2):
        run_step(sync, ref, WORLD, list(range(SIZE)), 30 + step, world_sizes("uneven"), (3, 2, 2), dtype)
    if not sync.track_running_stats:
        assert sync.running_mean is None and sync.running_var is None


def test_process_set_split():
    color = RANK % 2
    group = WORLD.split(color, key=RANK)
    members = group.allgather_object(RANK)
    sync, ref = make_pair(3, 3, torch.float64, process_set=StandIn(group))
    sizes = [UNEVEN[r % len(UNEVEN)] + 1 for r in members]
    for step in range(2):
        run_step(sync, ref, group, members, 40 + step + color, sizes, (3, 4), torch.float64)


def test_large_mean_small_spread_keeps_precision():
    sync, ref = make_pair(2, 2, torch.float64)
    members = list(range(SIZE))
    x = batch(50, RANK, 5, (2,), torch.float64) * 1e-4 + 1e6  # M2 pooling: no Σx² - (Σx)²/N cancellation
    xs = [batch(50, r, 5, (2,), torch.float64) * 1e-4 + 1e6 for r in members]
    y = sync(x)
    y_ref = ref(torch.cat(xs))
    torch.testing.assert_close(y, y_ref[5 * RANK:5 * RANK + 5], rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(sync.running_var, ref.running_var, rtol=1e-7, atol=0)


# ------------------------------------------------------ communication use
def test_one_allgather_forward_one_allreduce_backward():
    sync, _ = make_pair(6, 2, torch.float32)
    x = batch(60, RANK, 4, (6,), torch.float32).requires_grad_()
    before = WORLD.counters.snapshot()
    y = sync(x)
    mid = WORLD.counters.snapshot()
    y.square().sum().backward()
    after = WORLD.counters.snapshot()

    def calls(snap, op):
        return snap.get(op, {}).get("calls", 0)

    expect = (1, 0, 0, 1) if SIZE > 1 else (0, 0, 0, 0)
    assert (calls(mid, "allgather") - calls(before, "allgather"), calls(mid, "allreduce") - calls(before, "allreduce"),
            calls(after, "allgather") - calls(mid, "allgather"),
            calls(after, "allreduce") - calls(mid, "allreduce")) == expect


def test_no_input_gradient_means_no_backward_collective():
    sync, _ = make_pair(3, 2, torch.float32)
    x = batch(61, RANK, 4, (3,), torch.float32)  # no requires_grad: only weight and bias need gradients
    y = sync(x)
    before = WORLD.counters.snapshot().get("allreduce", {}).get("calls", 0)
    y.square().sum().backward()
    assert WORLD.counters.snapshot().get("allreduce", {}).get("calls", 0) == before
    assert sync.weight.grad is not None and sync.bias.grad is not None


# ----------------------------------------------------------------- eval
@pytest.mark.parametrize("track", [True, False])
def test_eval_mode_is_plain_batch_norm_without_communication(track):
    sync, ref = make_pair(3, 3, torch.float64, track_running_stats=track)
    for step in range(2):
        run_step(sync, ref, WORLD, list(range(SIZE)), 70 + step, world_sizes("even"), (3, 4), torch.float64)
    sync.eval()
    ref.eval()
    x = batch(79, RANK, 2 + RANK, (3, 4), torch.float64)  # a different batch size on each rank
    before = WORLD.counters.snapshot()
    y = sync(x)
    assert WORLD.counters.snapshot() == before  # nothing was sent (ranks may evaluate alone)
    torch.testing.assert_close(y, ref(x), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------- the function
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sync_function_on_one_rank_communicator(dtype):
    # The sync path itself (not the 1-rank F.batch_norm shortcut), on a communicator of one rank.
    alone = WORLD.split(RANK, key=0)
    x = batch(80, RANK, 5, (3, 4), dtype).requires_grad_()
    w = torch.rand(3, dtype=dtype, requires_grad=True)
    b = torch.randn(3, dtype=dtype, requires_grad=True)
    rm, rv = torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype)
    y = _SyncBatchNormFunction.apply(x, w, b, rm, rv, 1e-5, 0.1, alone)
    r = weights(80, 5, (3, 4), RANK, dtype)
    (y * r).sum().backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    rm2, rv2 = torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype)
    y2 = torch.nn.functional.batch_norm(x2, rm2, rv2, w2, b2, True, 0.1, 1e-5)
    (y2 * r).sum().backward()
    for got, want, what in [(y, y2, "output"), (x.grad, x2.grad, "input grad"), (w.grad, w2.grad, "weight grad"),
                            (b.grad, b2.grad, "bias grad"), (rm, rm2, "running_mean"), (rv, rv2, "running_var")]:
        close(got, want.detach(), dtype, what)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_normalised_in_float32(dtype):
    sync, ref = make_pair(3, 2, torch.float32)
    sync = sync.to(dtype)
    xs = [batch(81, r, 4, (3,), torch.float32) for r in range(SIZE)]
    y = sync(xs[RANK].to(dtype))
    assert y.dtype == dtype
    want = ref(torch.cat([x.to(dtype).float() for x in xs]))[4 * RANK:4 * RANK + 4]
    tol = 1e-2 if dtype == torch.float16 else 4e-2  # one rounding of the float32 result (and of weight, bias)
    torch.testing.assert_close(y.float(), want.detach(), rtol=tol, atol=tol)


# --------------------------------------------------------------- errors
def test_one_value_per_channel_over_all_ranks_raises_everywhere():
    sync = SyncBatchNorm(2)
    x = torch.randn(1 if RANK == 0 else 0, 2)  # one value per channel in total
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(x)


def test_wrong_shape_raises():
    sync = SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"expects input of shape \(N, 3, \.\.\.\), got \(4,\)"):
        sync(torch.randn(4))
    with pytest.raises(ValueError, match=r"got \(4, 2\)"):
        sync(torch.randn(4, 2))


def test_integer_input_raises():
    sync = SyncBatchNorm(2)
    if SIZE == 1:
        pytest.skip("one rank uses torch's own batch_norm")
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64 input"):
        sync(torch.ones(3, 2, dtype=torch.int64))


def test_comm_for():
    assert _comm_for(None) is WORLD
    stand_in = StandIn(WORLD)
    assert _comm_for(stand_in) is WORLD
    with pytest.raises(TypeError, match="has no .comm"):
        _comm_for(object())
    with pytest.raises(ValueError, match="not a member"):
        _comm_for(StandIn(None))


def test_constructor_matches_horovod_signature():
    m = SyncBatchNorm(5, 1e-3, 0.2, False, False)
    assert (m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats) == (5, 1e-3, 0.2, False, False)
    assert m.process_set is None
    assert isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
