"""commwire's collectives under FSDP2 — tier 2 (mpiexec -n 2 and 4, CPU, gloo).

Run by tests/torch/test_fsdp.py. References: FSDP2's own collectives (plain
``fully_shard``; native HSDP on a 2-D mesh) on the same model, data and steps in
the same job. With codec "none" the weights after 20 steps must equal FSDP2's
(rtol 1e-6: the same sums, possibly in another order); with FP8 the loss must
fall as FSDP2's does, within the FP8 error bound.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import commwire
import commwire.torch as hvd
from commwire.torch import fsdp as cw_fsdp

hvd.init()
hvd.init_process_group("gloo")
R, P = hvd.rank(), hvd.size()
V, D, T = 40, 32, 12  # vocabulary, width (5 heads' worth of rows is not a multiple of 4: uneven shards), length


class Tiny(torch.nn.Module):
    """A two-block transformer language model (causal), small enough for CPU tests."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True) for _ in range(2))
        self.odd = torch.nn.Linear(D, 5)  # 5 output rows: shards of unequal size (FSDP pads them)
        self.head = torch.nn.Linear(D + 5, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(torch.cat([h, self.odd(h)], dim=-1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * (step % 5) + rank)
    start = torch.randint(0, V, (8, 1), generator=g)
    seq = (start + torch.arange(T + 1) * 3) % V  # a learnable rule: next = current + 3 (mod V)
    return seq[:, :-1], seq[:, 1:]


def _shard(model: torch.nn.Module, mesh: Any = None) -> torch.nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: torch.nn.Module, steps: int = 20, rank: int = R, adam: bool = True) -> list[float]:
    # The equality tests use SGD: Adam divides by the gradient's running RMS, which turns the last-bit
    # differences of near-zero gradients (sums in another order) into visible weight differences.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3) if adam else torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _full(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.full_tensor().detach().numpy().copy() for k, v in model.state_dict().items()}


def _fresh(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Tiny()


def _mean_across(value: float) -> float:
    return float(np.mean(commwire.allgather_object(value)))


@pytest.mark.parametrize("transport", ["torch", "mpi"])
def test_codec_none_equals_fsdp2(transport):
    plain = _shard(_fresh())
    plain_losses = _train(plain, adam=False)
    mine = _shard(_fresh())
    state = cw_fsdp.compress(mine, reduce_scatter="none", all_gather="none", transport=transport)
    mine_losses = _train(mine, adam=False)
    assert state.calls["reduce_scatter"] == 20 * 3 and state.calls["all_gather"] >= 20 * 3
    np.testing.assert_allclose(mine_losses, plain_losses, rtol=1e-6)
    want, got = _full(plain), _full(mine)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    assert plain_losses[-1] < 0.7 * plain_losses[0]  # the reference itself learns: a real check


def _train_accumulating(model: torch.nn.Module, steps: int = 6, micro: int = 2) -> None:
    """SGD steps of ``micro`` micro-batches each, syncing gradients only on the last (FSDP2's no_sync)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            x, y = _batch(step * micro + m, R)
            (torch.nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1)) / micro).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("setting", ["no-reshard", "accumulate", "bf16-params"])
def test_codec_none_equals_fsdp2_with_its_options(setting):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kw = {"no-reshard": {"reshard_after_forward": False},
          "bf16-params": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
          }.get(setting, {})

    def run(model: torch.nn.Module) -> None:
        _train_accumulating(model) if setting == "accumulate" else _train(model, steps=6, adam=False)

    def shard(model: torch.nn.Module) -> torch.nn.Module:
        for block in model.blocks:
            fully_shard(block, **kw)
        return fully_shard(model, **kw)

    plain, mine = shard(_fresh()), shard(_fresh())
    run(plain)
    state = cw_fsdp.compress(mine, reduce_scatter="none", all_gather="none")
    run(mine)
    assert state.calls["reduce_scatter"] == 6 * 3  # once per step and module: none in the no-sync micro-batches
    want, got, start = _full(plain), _full(mine), _full(shard(_fresh()))
    assert not all(np.array_equal(want[k], start[k]) for k in want)  # it trained
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("rs,ag,tol", [("ef+fp8-e4m3", "fp8-e4m3", 0.05), ("ef+nvfp4", None, 0.15),
                                       ("fp8-e4m3", "nvfp4", 0.2)])
def test_compressed_training_follows_fsdp2(rs, ag, tol):
    plain_losses = _train(_shard(_fresh(1)), steps=25)
    mine = _shard(_fresh(1))
    state = cw_fsdp.compress(mine, reduce_scatter=rs, all_gather=ag)
    losses = _train(mine, steps=25)
    assert np.isfinite(losses).all()
    # final loss (mean over ranks, last 5 steps) within tol of FSDP2's, relative to how far it fell
    drop = np.mean(plain_losses[:3]) - np.mean(plain_losses[-5:])
    gap = abs(_mean_across(np.mean(losses[-5:])) - _mean_across(np.mean(plain_losses[-5:])))
    assert drop > 0.5 and gap < tol * drop + 0.02, (plain_losses[-5:], losses[-5:])
    if rs.startswith("ef+"):
        residuals = state.codecs["reduce_scatter"].stages[0].state
        assert ("fsdp.blocks.0.rs", "rs") in residuals.keys() if P > 1 else True
    # every rank holds the same (quantised) parameters after the gather: same outputs everywhere
    x, _ = _batch(0, 0)
    with torch.no_grad():
        out = mine(x).numpy()
    assert len({hash(out.tobytes()) for out in commwire.allgather_object(out)}) == 1


def test_state_dict_and_checkpoint(tmp_path_factory):
    model = _shard(_fresh(2))
    state = cw_fsdp.compress(model, reduce_scatter="ef+fp8-e4m3", all_gather="fp8-e4m3")
    _train(model, steps=3)
    saved = state.state_dict()
    path = commwire.broadcast_object(str(tmp_path_factory.mktemp("ckpt") / "fsdp") if R == 0 else None)
    commwire.checkpoint.save(path, {"fsdp": state})
    other = cw_fsdp.compress(_shard(_fresh(2)), reduce_scatter="ef+fp8-e4m3", all_gather="fp8-e4m3")
    commwire.checkpoint.load(path, {"fsdp": other})
    assert other.calls == saved["calls"]
    for key in saved["codecs"]["reduce_scatter"]["stages"][0]:
        a = saved["codecs"]["reduce_scatter"]["stages"][0][key]["residual"]
        b = other.codecs["reduce_scatter"].stages[0].state.slot(key)["residual"]
        np.testing.assert_array_equal(a, b)
        assert np.abs(a).max() > 0
    with pytest.raises(ValueError, match="same codecs"):
        cw_fsdp.compress(_shard(_fresh(2)), reduce_scatter="nvfp4").load_state_dict(saved)


def test_bad_input():
    with pytest.raises(ValueError, match="no FSDPModule"):
        cw_fsdp.compress(torch.nn.Linear(3, 3))
    model = _shard(_fresh())
    with pytest.raises(ValueError, match="transforms whole weight matrices"):
        cw_fsdp.compress(model, reduce_scatter="gift+fp8-e4m3")
    with pytest.raises(ValueError, match="error feedback compensates sums"):
        cw_fsdp.compress(model, all_gather="ef+fp8-e4m3")
    with pytest.raises(ValueError, match="needs replicate_group"):
        cw_fsdp.compress(model, replicate="ef+nvfp4")
    with pytest.raises(ValueError, match="transport='nccl'"):
        cw_fsdp.compress(model, transport="nccl")
    with pytest.raises(ValueError, match="fp7"):
        cw_fsdp.compress(model, reduce_scatter="fp7")
    assert isinstance(model, FSDPModule)


@pytest.mark.skipif(P != 4, reason="HSDP needs 2 replicas x 2 shards")
def test_hsdp_replicate_none_equals_native_hsdp():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    native = _shard(_fresh(3), mesh=mesh)
    native_losses = _train(native, steps=15, adam=False)
    mine = _shard(_fresh(3), mesh=mesh["shard"])
    state = cw_fsdp.compress(mine, reduce_scatter="none", all_gather=None, replicate="none",
                             replicate_group=mesh["replicate"])
    mine_losses = _train(mine, steps=15, adam=False)
    assert state.calls["replicate"] == 15 * 3
    np.testing.assert_allclose(mine_losses, native_losses, rtol=1e-6)
    want = {k: v.full_tensor().detach().numpy() for k, v in native.state_dict().items()}
    for k, v in mine.state_dict().items():
        np.testing.assert_allclose(v.full_tensor().detach().numpy(), want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    with pytest.raises(ValueError, match="native HSDP"):
        cw_fsdp.compress(_shard(_fresh(3), mesh=mesh), replicate="none", replicate_group=mesh["replicate"])


@pytest.mark.skipif(P != 4, reason="HSDP needs 2 replicas x 2 shards")
def test_hsdp_compressed_replicate_follows_native():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    native_losses = _train(_shard(_fresh(4), mesh=mesh), steps=25)
    mine = _shard(_fresh(4), mesh=mesh["shard"])
    cw_fsdp.compress(mine, reduce_scatter=None, all_gather=None, replicate="ef+nvfp4",
                     replicate_group=mesh["replicate"])
    losses = _train(mine, steps=25)
    drop = np.mean(native_losses[:3]) - np.mean(native_losses[-5:])
    gap = abs(_mean_across(np.mean(losses[-5:])) - _mean_across(np.mean(native_losses[-5:])))
    assert drop > 0.5 and gap < 0.15 * drop + 0.02
    # replicas agree: ranks holding the same shard hold identical parameters
    local = np.concatenate([v.to_local().detach().numpy().ravel() for v in mine.state_dict().values()])
    peers = commwire.allgather_object(local.tobytes())
    assert peers[R] == peers[(R + 2) % 4]
    dist.barrier()


def test_bench_fsdp_runs_every_kind_of_configuration():
    from commwire.bench.fsdp import run_fsdp_bench

    hsdp = ("hsdp", "hsdp rs=fp8-e4m3 ag=fp8-e4m3 replicate=ef+fp8-e4m3") if P == 4 else ()
    configs = ("fsdp", "fsdp bf16", "commwire rs=ef+fp8-e4m3 ag=fp8-e4m3", "commwire rs=nvfp4", *hsdp)
    rows = run_fsdp_bench(configs=configs, d_model=16, layers=1, batch=2, context=8, steps=2, rounds=2, batches=3)
    by = {r["config"]: r for r in rows}
    assert [r["config"] for r in rows] == list(configs)
    for r in rows:
        assert len(r["val_curve"]) == 2 and np.isfinite(r["val_curve"]).all() and r["val_loss"] == r["val_curve"][-1]
        assert r["step_ms"] > 0
    # FSDP's FP32 reduce-scatter sends (P-1)/P of its input, its all-gather the rank's shard; bf16 halves both;
    # commwire's FP8 sends a byte per element plus a scale and a flag byte per message.
    assert by["fsdp"]["rs_MB"] > 0 and by["fsdp"]["ag_MB"] > 0 and by["fsdp"]["ar_MB"] == 0
    assert abs(by["fsdp bf16"]["bytes_vs_fp32"] - 0.5) < 1e-9
    fp8 = by["commwire rs=ef+fp8-e4m3 ag=fp8-e4m3"]
    assert 0.24 < fp8["rs_vs_first"] < 0.30 and 0.24 < fp8["bytes_vs_fp32"] < 0.30
    assert by["commwire rs=nvfp4"]["ag_MB"] == by["fsdp"]["ag_MB"]  # FSDP's own all-gather, seen by the wrapper
    if hsdp:
        native, ours = by["hsdp"], by[hsdp[1]]
        assert native["ar_MB"] > 0 and 0.24 < ours["ar_MB"] / native["ar_MB"] < 0.30
