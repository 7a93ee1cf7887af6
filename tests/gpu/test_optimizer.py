"""DistributedOptimizer with parameters on ``cuda:N`` (N = local rank) — tier 3 (GPU).

Training on every rank's shard of a batch with DistributedOptimizer must match
single-process training on the whole batch (the mean of the ranks' mean
losses): to 1e-5 without compression, to the codec's tolerance with it. The
fusion buckets must live on the parameters' device (gradients become views of
them), and the reduction must take the direct path on a CUDA-aware
communicator and the staged one otherwise. Buckets are reduced on the
background lane while backward runs on the autograd engine's device thread:
this is where the stream ordering of lane work is exercised for real.
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu import device, skip_unless_cuda_aware
from mpi4py import MPI

import commwire as cw
from commwire.comm import arrays

torch = pytest.importorskip("torch")

WORLD = cw.init()
P, R = WORLD.size, WORLD.rank


def _model(dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 1)).to(dev)


@pytest.mark.parametrize("path", ["direct", "staged"])
@pytest.mark.parametrize("compression, tol", [("none", 1e-5), ("fp16", 2e-3), ("ef+fp8-e4m3", 3e-2)])
def test_matches_single_process_training(path, compression, tol, monkeypatch):
    from commwire.torch.optimizer import DistributedOptimizer

    if P < 2:
        pytest.skip("one rank: an all-reduce over one rank changes nothing (run under mpiexec -n 2)")
    if path == "direct":
        skip_unless_cuda_aware()
    dev = device()
    comm = cw.Communicator(MPI.COMM_WORLD.Dup(), cuda_aware=path == "direct", uid=f"opt-{path}-{compression}")
    ops = type(arrays.device_ops(torch.ones(1, device=dev)))
    seen = {"to_host": 0, "synchronize": 0}
    for name in seen:
        real = getattr(ops, name)

        def counted(self, *args, _real=real, _name=name):
            seen[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(ops, name, counted)
    model, reference = _model(dev), _model(dev)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters(),
                               compression=compression, comm=comm, fusion_threshold_mb=0.1, first_bucket_mb=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    assert len(opt._fusion.buckets) > 1
    assert all(b.buffer.device == dev for b in opt._fusion.buckets)  # buckets on the parameters' device
    gen = torch.Generator(device=dev).manual_seed(1)
    for _ in range(5):
        xs = torch.randn(8 * P, 32, device=dev, generator=gen)
        ys = torch.randn(8 * P, 1, device=dev, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[8 * R:8 * R + 8]), ys[8 * R:8 * R + 8]).backward()
        opt.step()
        ref_opt.zero_grad()
        sum(torch.nn.functional.mse_loss(reference(xs[8 * r:8 * r + 8]), ys[8 * r:8 * r + 8])
            for r in range(P)).div(P).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.device == dev
        err = (p.detach() - q.detach()).abs().max().item() / max(q.detach().abs().max().item(), 1e-6)
        assert err < tol, (name, err)
    if compression == "none":  # the plain all-reduce's path (the compressed one stages payloads itself)
        assert seen["synchronize" if path == "direct" else "to_host"] > 0, seen
        assert seen["to_host" if path == "direct" else "synchronize"] == 0, seen


def test_ranks_end_with_identical_parameters():
    from commwire.torch.optimizer import DistributedOptimizer

    if P < 2:
        pytest.skip("one rank: nothing to agree with (run under mpiexec -n 2)")
    dev = device()
    model = _model(dev)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model.named_parameters(),
                               compression="ef+nvfp4")
    for step in range(3):
        x = torch.randn(16, 32, device=dev, generator=torch.Generator(device=dev).manual_seed(10 * step + R))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = WORLD.allgather(flat[None].cpu().numpy())
    for r in range(P):
        np.testing.assert_array_equal(everyone[r], everyone[0])
