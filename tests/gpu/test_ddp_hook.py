"""commwire's DDP hook on CUDA gradients — tier 3 (GPU).

The hook reduces each bucket on the background lane, on a side stream, and
completes a CUDA-aware Future there; DDP must then read the reduced bucket, not
the one backward wrote. Reference: plain DDP (its own all-reduce) on the same
model, data and steps. With codec "none" the weights after 20 steps must equal
plain DDP's (rtol 1e-6: DDP divides before summing, commwire after); with
ef+fp8-e4m3 the loss must fall as plain DDP's does. torch.distributed runs gloo,
which moves CUDA tensors for DDP itself (NCCL refuses two ranks on one GPU); the
hook reduces over MPI (``transport="mpi"``: commwire's torch transport takes CUDA
tensors only on NCCL groups, tested in test_nccl.py with one rank per GPU).
"""

from __future__ import annotations

import pytest
from _gpu import device

import commwire.torch as hvd

torch = pytest.importorskip("torch")

hvd.init()


def _train(codec, dev, steps=20):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 1)).to(dev)
    ddp = DDP(model, device_ids=[dev] if dev.type == "cuda" else None, bucket_cap_mb=1)
    if codec is not None:
        state, hook = hvd.ddp_hook(codec, model=ddp, transport="mpi")
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    g = torch.Generator(device="cpu").manual_seed(100 + hvd.rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(256, 64, generator=g).to(dev)
        y = x[:, :1] * 0.5 - x[:, 1:2] ** 2
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def test_hook_hands_ddp_the_reduced_buckets_on_the_device():
    import torch.distributed as dist

    dev = device()
    if not dist.is_initialized():
        hvd.init_process_group("gloo")
    ref, ref_losses = _train(None, dev)
    got, _ = _train("none", dev)
    for (name, a), b in zip(ref.named_parameters(), got.parameters()):
        assert b.device == a.device
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=name)
    _, fp8_losses = _train("ef+fp8-e4m3", dev)
    assert ref_losses[-1] < 0.8 * ref_losses[0]
    assert abs(fp8_losses[-1] - ref_losses[-1]) <= 0.05 * ref_losses[0], (fp8_losses[-1], ref_losses[-1])
