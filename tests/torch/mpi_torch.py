"""DistributedOptimizer on several ranks — tier 2 (run under mpiexec by test_torch.py).

Reference: single-process training of an identical model on the concatenated
batch of all ranks. Tolerance for uncompressed runs: relative 1e-5 on the
parameters (float32 reduction order differs from the single-process sum).
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

import commwire.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
BATCH = 8  # per rank


def make_model(seed: int = 0, layers: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    mods.append(torch.nn.Linear(16, 1))
    return torch.nn.Sequential(*mods)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(BATCH, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def full_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(step, r) for r in range(SIZE)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def make_opt(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3)


def flat_params(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("fusion_mb,overlap", [(25.0, True), (0.0005, True), (0.0, False)])
def test_matches_single_process_on_concatenated_batch(kind, fusion_mb, overlap):
    model = make_model()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(make_opt(kind, model.parameters()), named_parameters=model.named_parameters(),
                                   fusion_threshold_mb=fusion_mb, first_bucket_mb=fusion_mb, overlap=overlap)
    ref_opt = make_opt(kind, ref.parameters())
    if fusion_mb < 0.01:
        assert len(opt._fusion.buckets) > 3  # tiny thresholds force the multi-bucket path
    for step in range(5):
        opt.zero_grad()
        loss_fn(model, *batch(step, RANK)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, *full_batch(step)).backward()
        ref_opt.step()
    np.testing.assert_allclose(flat_params(model), flat_params(ref), rtol=1e-5, atol=1e-6)


def test_backward_passes_per_step_equals_doubled_batch():
    model, ref = make_model(1), make_model(1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    ref_opt = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                       named_parameters=ref.named_parameters())
    for step in range(3):
        opt.zero_grad()
        xa, ya = batch(2 * step, RANK)
        xb, yb = batch(2 * step + 1, RANK)
        (loss_fn(model, xa, ya) / 2).backward()  # Horovod convention: scale the loss by 1/passes
        (loss_fn(model, xb, yb) / 2).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, torch.cat([xa, xb]), torch.cat([ya, yb])).backward()
        ref_opt.step()
    np.testing.assert_allclose(flat_params(model), flat_params(ref), rtol=1e-5, atol=1e-6)


def test_too_many_backward_passes_is_an_error():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    loss_fn(model, *batch(0, RANK)).backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step=2"):
        loss_fn(model, *batch(1, RANK)).backward()
    opt.synchronize()


def _fit(compression: str, steps: int = 150) -> tuple[float, float]:
    model = make_model(2, layers=2)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                   named_parameters=model.named_parameters(), compression=compression)
    teacher = torch.linspace(-1, 1, 16).reshape(16, 1)
    x_eval = full_batch(999)[0]
    with torch.no_grad():
        first = float(loss_fn(model, x_eval, x_eval @ teacher))
    for step in range(steps):
        x = batch(step, RANK)[0]
        opt.zero_grad()
        loss_fn(model, x, x @ teacher).backward()
        opt.step()
    with torch.no_grad():
        final = float(loss_fn(model, x_eval, x_eval @ teacher))
    params = flat_params(model)  # all ranks must hold the same model
    np.testing.assert_array_equal(hvd.broadcast(torch.from_numpy(params), 0).numpy(), params)
    return first, final


@pytest.mark.parametrize("compression", ["fp16", "bf16", "fp8-e4m3", "ef+fp8-e4m3", "nvfp4", "ef+nvfp4", "ef+mxfp4",
                                         "int8", "ef+sign"])
def test_each_compression_converges(compression):
    first, fp32 = _fit("none")
    _, final = _fit(compression)
    assert fp32 < 0.05 * first  # the task is learnable in this many steps
    # documented bound: a compressed run ends within 2x of FP32's loss and far below the start
    assert final < max(2.0 * fp32, 0.05 * first), (compression, first, fp32, final)


def _train(model, opt, steps, start):
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_fn(model, *batch(step, RANK)).backward()
        opt.step()


def test_checkpoint_resume_is_bit_identical_with_error_feedback():
    model = make_model(3)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                   named_parameters=model.named_parameters(), compression="ef+fp8-e4m3")
    _train(model, opt, 4, 0)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    assert opt.state_dict()["commwire"]["codec"]["stages"][0]  # residuals present
    _train(model, opt, 4, 4)
    uninterrupted = flat_params(model)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model2 = make_model(99)
    opt2 = hvd.DistributedOptimizer(torch.optim.Adam(model2.parameters(), lr=1e-2),
                                    named_parameters=model2.named_parameters(), compression="ef+fp8-e4m3")
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    _train(model2, opt2, 4, 4)
    np.testing.assert_array_equal(flat_params(model2), uninterrupted)


def test_resume_without_codec_state_differs():
    # Guards the test above: dropping the residuals must change the trajectory.
    model = make_model(3)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                   named_parameters=model.named_parameters(), compression="ef+fp8-e4m3")
    _train(model, opt, 4, 0)
    sd_model, sd_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, 4, 4)
    model2 = make_model(99)
    opt2 = hvd.DistributedOptimizer(torch.optim.Adam(model2.parameters(), lr=1e-2),
                                    named_parameters=model2.named_parameters(), compression="ef+fp8-e4m3")
    model2.load_state_dict(sd_model)
    sd_opt.pop("commwire")
    opt2.load_state_dict(sd_opt)
    _train(model2, opt2, 4, 4)
    assert not np.array_equal(flat_params(model2), flat_params(model))


def test_skip_synchronize_for_gradient_clipping():
    model, ref = make_model(4), make_model(4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt.zero_grad()
    loss_fn(model, *batch(0, RANK)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with opt.skip_synchronize():
        opt.step()
    ref_opt.zero_grad()
    loss_fn(ref, *full_batch(0)).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    ref_opt.step()
    np.testing.assert_allclose(flat_params(model), flat_params(ref), rtol=1e-5, atol=1e-6)


def test_misuse_errors():
    model = make_model()
    with pytest.raises(ValueError, match="duplicate names"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("a", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="missing from named_parameters"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:2])
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    with pytest.raises(RuntimeError, match="call loss.backward"):
        opt.step()
    loss_fn(model, *batch(0, RANK)).backward()
    with pytest.raises(RuntimeError, match="in flight"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_unused_parameters():
    model = make_model(5, layers=1)
    extra = torch.nn.Linear(16, 1)  # used on rank 0 only
    never = torch.nn.Linear(16, 1)  # used nowhere
    modules = torch.nn.ModuleDict({"m": model, "extra": extra, "never": never})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(modules.parameters(), lr=0.1),
                                   named_parameters=modules.named_parameters(), find_unused_parameters=True)
    x, y = batch(0, RANK)
    loss = loss_fn(model, x, y)
    if RANK == 0:
        loss = loss + extra(x).pow(2).mean()
    loss.backward()
    opt.synchronize()
    assert never.weight.grad is None
    assert extra.weight.grad is not None
    grads = hvd.allgather(extra.weight.grad.reshape(1, -1))
    np.testing.assert_array_equal(grads.numpy(), np.repeat(grads[:1].numpy(), SIZE, axis=0))


def test_broadcast_parameters_and_optimizer_state():
    model = make_model(seed=RANK)  # different on every rank
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (RANK + 1))
    loss_fn(model, *batch(0, RANK)).backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    np.testing.assert_array_equal(flat_params(model), flat_params(make_model(seed=0)) if False else
                                  hvd.broadcast(torch.from_numpy(flat_params(model)), 0).numpy())
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    from commwire.torch.functions import check_same_parameters

    check_same_parameters(list(model.named_parameters()))
    if SIZE > 1:
        other = make_model(seed=RANK)
        with pytest.raises(ValueError, match="differs between ranks"):
            check_same_parameters(list(other.named_parameters()))


def test_tensor_functions():
    t = torch.full((3,), float(RANK))
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum), torch.full((3,), float(sum(range(SIZE)))))
    assert torch.allclose(hvd.allreduce(t), torch.full((3,), (SIZE - 1) / 2))
    h = hvd.allreduce_async(t, op=hvd.Max, name="m")
    assert torch.equal(hvd.synchronize(h), torch.full((3,), float(SIZE - 1)))
    assert hvd.allgather(torch.ones(RANK + 1, 2)).shape == (SIZE * (SIZE + 1) // 2, 2)
    u = torch.full((2,), float(RANK))
    hvd.broadcast_(u, root_rank=SIZE - 1)
    assert torch.equal(u, torch.full((2,), float(SIZE - 1)))
    assert hvd.broadcast_object({"r": RANK}, 0) == {"r": 0}
    v = torch.ones(5)
    assert hvd.allreduce_(v, op=hvd.Sum) is v and torch.equal(v, torch.full((5,), float(SIZE)))
    q = hvd.allreduce(torch.randn(1000, generator=torch.Generator().manual_seed(RANK)),
                      compression=hvd.Compression.fp8, name="q")
    assert q.shape == (1000,)


def test_lr_scheduler_accepts_wrapper():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loss_fn(model, *batch(0, RANK)).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("policy", ["propagate", "skip", "raise"])
def test_nonfinite_gradient_policies_agree_on_every_rank(policy):
    model = make_model(6, layers=1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), on_nonfinite=policy)
    before = flat_params(model)
    x, y = batch(0, RANK)
    if RANK == SIZE - 1:
        x = x.clone()
        x[0, 0] = float("inf")  # only the last rank overflows
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="non-finite averaged gradients"):
            opt.step()
        return
    opt.step()
    after = flat_params(model)
    if policy == "skip":
        np.testing.assert_array_equal(after, before)  # skipped on every rank, not only the last
        assert opt.skipped_steps == 1 and opt.nonfinite
    else:
        assert not np.isfinite(after).all()  # NaN reached the weights: AMP-style scalers can see it


def test_one_call_checkpoint_resumes_ef_gift_lordo_and_shared_codecs_bit_identically(tmp_path_factory):
    import commwire as cw
    from commwire.bench.lm import Corpus, LMConfig, make_lm

    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("ckpt") / "step") if RANK == 0 else None, 0)
    corpus = Corpus.load()
    cfg = LMConfig(d_model=32, layers=1, context=16, heads=2)

    def build():
        lm = make_lm(cfg, seed=0)
        opt = hvd.DistributedOptimizer(torch.optim.Adam(lm.parameters(), lr=1e-3),
                                       named_parameters=lm.named_parameters(),
                                       compression="gift:refresh=2+ef+fp8-e4m3", model=lm)
        mlp = make_model(7, layers=1)
        lordo = hvd.LoRDO(mlp.named_parameters(), lr=1e-2, rank=4, sync_every=2)
        return {"lm": lm, "opt": opt, "mlp": mlp, "lordo": lordo}

    def train(objs, steps, start):
        for step in range(start, start + steps):
            g = torch.Generator().manual_seed(100 * step + RANK)
            x, y = corpus.batch("train", batch=4, context=16, generator=g)
            objs["opt"].zero_grad()
            objs["lm"].loss(x, y).backward()
            objs["opt"].step()
            objs["lordo"].zero_grad()
            loss_fn(objs["mlp"], *batch(step, RANK)).backward()
            objs["lordo"].step()
            side = np.random.default_rng(step * 10 + RANK).standard_normal(300).astype(np.float32)
            cw.allreduce(side, codec="ef+nvfp4", name="side")  # shared string-spec codec state

    def snapshot(objs):
        return {"lm": flat_params(objs["lm"]), "mlp": flat_params(objs["mlp"])}

    first = build()
    train(first, 5, 0)
    cw.checkpoint.save(path, first)
    train(first, 4, 5)
    uninterrupted = snapshot(first)

    second = build()
    ckpt = cw.checkpoint.load(path, second)
    assert isinstance(ckpt, str)
    train(second, 4, 5)
    resumed = snapshot(second)
    np.testing.assert_array_equal(resumed["mlp"], uninterrupted["mlp"])  # LoRDO
    np.testing.assert_array_equal(resumed["lm"], uninterrupted["lm"])  # EF + GIFT
    with pytest.raises(ValueError, match="holds objects"):
        cw.checkpoint.load(path, {"lm": second["lm"]})
