"""DiLoCo with a caller's inner and outer torch optimizers — tier 1 (one process).

The built-in path (AdamW inner, Nesterov SGD outer) is covered by
``test_lordo.py`` and ``mpi_lordo.py``. Here: torch's own optimizers in either
place reproduce the built-in ones; an SGD inner optimizer matches a
hand-written loop; checkpoints carry both optimizers; bad arguments are
refused, naming the argument. The 2-rank comparison with a hand-written loop
is in ``mpi_lordo.py``.
"""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")

import commwire as cw  # noqa: E402
import commwire.torch as hvd  # noqa: E402

torch.set_num_threads(1)
K = 3


@pytest.fixture(scope="module", autouse=True)
def world():
    return cw.init()


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 6, generator=g)
    return x, torch.stack([x[:, :3].sum(1).sin(), x[:, 3:].sum(1).cos()], 1)


def train(model, opt, steps) -> None:
    for s in steps:
        x, y = batch(s)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def test_torch_optimizers_reproduce_the_built_in_ones():
    base, custom, torchft = make_model(), make_model(), make_model()
    opts = [
        hvd.DiLoCo(base.named_parameters(), lr=1e-2, sync_every=K),
        hvd.DiLoCo(custom.named_parameters(), sync_every=K, outer_optimizer=nesterov,
                   inner_optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)),
        # torchft's way: both optimizers built over the model's own parameters.
        hvd.DiLoCo(torchft.named_parameters(), sync_every=K, outer_optimizer=nesterov(torchft.parameters()),
                   inner_optimizer=torch.optim.Adam(torchft.parameters(), lr=1e-2, betas=(0.9, 0.95))),
    ]
    for model, opt in zip((base, custom, torchft), opts):
        train(model, opt, range(3 * K + 1))
    for other in (custom, torchft):
        for p, q in zip(base.parameters(), other.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert opts[1].bytes_per_sync == opts[0].bytes_per_sync and opts[1]._sync.syncs == 3


def test_sgd_inner_matches_a_hand_written_loop():
    model, ref = make_model(), make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DiLoCo(model.named_parameters(), sync_every=K, inner_optimizer=inner)
    train(model, opt, range(2 * K + 1))
    theta = [p.detach().clone() for p in ref.parameters()]
    anchor = [t.clone() for t in theta]
    buf = [torch.zeros_like(t) for t in theta]
    for s in range(2 * K + 1):
        with torch.no_grad():
            for p, t in zip(ref.parameters(), theta):
                p.copy_(t)
        ref.zero_grad()
        x, y = batch(s)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for t, p in zip(theta, ref.parameters()):
            t -= 0.1 * p.grad
        if (s + 1) % K == 0:  # one rank: the average pseudo-gradient is the local one
            for t, a, b in zip(theta, anchor, buf):
                d = a - t
                b.mul_(0.9).add_(d)
                a -= 0.7 * (d + 0.9 * b)
                t.copy_(a)
    for p, t in zip(model.parameters(), theta):
        torch.testing.assert_close(p.detach(), t, rtol=1e-6, atol=1e-7)


def test_factory_gets_the_param_groups_and_state_is_counted():
    model = make_model()
    groups = [{"params": list(model[0].parameters()), "lr": 0.05}, {"params": list(model[2].parameters())}]
    seen = []

    def factory(given):
        seen.append([set(g) for g in given])
        return torch.optim.SGD(given, lr=0.01, momentum=0.5)

    opt = hvd.DiLoCo(groups, sync_every=K, inner_optimizer=factory)
    assert seen == [[{"params", "lr"}, {"params"}]]  # the caller's keys, not DiLoCo's defaults
    assert [g["lr"] for g in opt.inner_optimizer.param_groups] == [0.05, 0.01]
    assert not opt.state  # the inner optimizer holds the state, not DiLoCo
    train(model, opt, range(2))
    P = sum(p.numel() for p in model.parameters())
    # reference copies, the built-in outer momentum, the inner SGD momentum buffers
    assert opt.state_bytes() == 3 * 4 * P


@pytest.mark.parametrize("outer", ["factory", "model"])
def test_checkpoint_carries_both_optimizers(outer):
    def build():
        model = make_model()
        out = nesterov if outer == "factory" else nesterov(model.parameters())
        return model, hvd.DiLoCo(model.named_parameters(), sync_every=K, outer_optimizer=out,
                                 inner_optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))

    model, opt = build()
    train(model, opt, range(K + 1))  # after a sync (outer momentum) and mid-period (inner moments)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    train(model, opt, range(K + 1, 3 * K + 2))
    model2, opt2 = build()
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(model2, opt2, range(K + 1, 3 * K + 2))
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), name
    plain_model = make_model()
    plain = hvd.DiLoCo(plain_model.named_parameters(), sync_every=K)
    with pytest.raises(ValueError, match="inner_optimizer"):
        plain.load_state_dict(saved["opt"])


def _bad_arguments():
    other = make_model(1)
    return [
        ({"inner_optimizer": "sgd"}, TypeError, "inner_optimizer must be a torch.optim.Optimizer"),
        ({"inner_optimizer": torch.nn.Linear(2, 2)}, TypeError, "inner_optimizer must be"),
        ({"inner_optimizer": lambda ps: None}, TypeError, "inner_optimizer returned NoneType"),
        ({"inner_optimizer": torch.optim.SGD(other.parameters(), lr=0.1)}, ValueError,
         "inner_optimizer optimizes other tensors than params"),
        ({"outer_optimizer": 0.7}, TypeError, "outer_optimizer must be a torch.optim.Optimizer"),
        ({"outer_optimizer": torch.optim.SGD(other.parameters(), lr=0.7)}, ValueError,
         "outer_optimizer optimizes other tensors than params"),
        ({"outer_optimizer": lambda ps: torch.optim.SGD(other.parameters(), lr=0.7)}, ValueError,
         "outer_optimizer optimizes other tensors than the reference copies"),
        ({"inner_optimizer": torch.optim.SGD, "lr": 0.1}, ValueError, "lr configure DiLoCo's built-in"),
        ({"inner_optimizer": torch.optim.SGD, "average_moments": True}, ValueError, "average_moments"),
        ({"outer_optimizer": nesterov, "outer_lr": 0.5, "nesterov": False}, ValueError, "outer_lr, nesterov"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_bad_arguments_are_refused_naming_them(case):
    kwargs, error, match = _bad_arguments()[case]
    model = make_model()
    with pytest.raises(error, match=match):
        hvd.DiLoCo(model.named_parameters(), sync_every=K, **kwargs)


def test_one_optimizer_for_both_roles_is_refused():
    model = make_model()
    both = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="same object"):
        hvd.DiLoCo(model.named_parameters(), inner_optimizer=both, outer_optimizer=both)


def test_an_optimizer_class_is_a_factory():
    model = make_model()
    opt = hvd.DiLoCo(model.named_parameters(), sync_every=K, inner_optimizer=torch.optim.SGD)
    assert isinstance(opt.inner_optimizer, torch.optim.SGD)
    train(model, opt, range(K))
    assert opt.local_steps == K and opt._sync.syncs == 1
