"""LoRDO / DiLoCo / LocalSync — tier 1 (one process) plus the tier-2 wrapper that runs mpi_lordo.py.

Single-process checks: bad input raises with the value; the full-rank fallback;
the math on numpy and torch agrees; a refresh within the same subspace
preserves the moments exactly (rotation); ω = 1 stagnates on one rank too;
optimizer-state memory follows 2·r·max(m, n); the low-rank DDP baseline
refreshes its basis. The multi-rank suite runs on 2 and 4 ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import run_mpi_pytest

torch = pytest.importorskip("torch")

import commwire as cw  # noqa: E402
import commwire.torch as hvd  # noqa: E402
from commwire.schedules import LocalSyncConfig, LoRDOConfig  # noqa: E402
from commwire.schedules import lordo as L  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def world():
    return cw.init()


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 2))


def train(model, opt, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g)
        y = torch.stack([x[:, :4].sum(1).sin(), x[:, 4:].prod(1).tanh()], 1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("kwargs,match", [
    ({"sync_every": 0}, "sync_every=0"),
    ({"sync_every": -3}, "sync_every=-3"),
    ({"sync_every": 2.5}, "sync_every=2.5"),
    ({"omega": 1.5}, "omega=1.5"),
    ({"omega": -0.1}, "omega=-0.1"),
    ({"rank": 0}, "rank=0"),
    ({"sync_states": ("adam",)}, "unknown"),
    ({"error_feedback": False, "sync_states": ("error_feedback",)}, "error_feedback=False"),
    ({"outer_momentum": 1.0}, "outer_momentum=1.0"),
    ({"lr": 0.0}, "lr=0.0"),
])
def test_bad_input_raises_naming_the_value(kwargs, match):
    args = {"lr": 1e-2, "rank": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        hvd.LoRDO(make_model().named_parameters(), **args)


def test_configs_are_frozen_and_validate():
    cfg = LocalSyncConfig(sync_every=8)
    with pytest.raises(AttributeError):
        cfg.sync_every = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="sync_every=True"):
        LocalSyncConfig(sync_every=True)
    with pytest.raises(ValueError, match="betas"):
        LoRDOConfig(rank=2, betas=(0.9, 1.0))


def test_rank_at_least_the_smaller_dimension_falls_back_to_full_rank():
    model = make_model()
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=12)
    # 16 x 12 and 2 x 24 have min dim <= 12: full-rank Adam; 24 x 16 is projected.
    assert opt.projected_names == ["2.weight"]
    assert "basis" not in opt.state[model[0].weight]
    assert opt.state[model[0].weight]["exp_avg"].shape == (16, 12)
    train(model, opt, 5)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("shape", [(6, 9), (9, 6)])
def test_numpy_and_torch_math_agree(shape):
    rng = np.random.default_rng(1)
    cfg = LoRDOConfig(rank=3, omega=0.8, clip=5.0)
    w, grads, delta = (rng.standard_normal(shape) for _ in range(3))
    states = {"np": L.init_lowrank_state(w, 3, error_feedback=True),
              "torch": L.init_lowrank_state(torch.from_numpy(w), 3, error_feedback=True)}
    params = {"np": w.copy(), "torch": torch.from_numpy(w.copy())}
    conv = {"np": np.asarray, "torch": torch.from_numpy}
    for k in states:
        L.lowrank_bootstrap(states[k], conv[k](grads), 3)
        for t in range(1, 4):
            L.lowrank_step(params[k], conv[k](grads * t), states[k], lr=0.01, step=t, config=cfg)
        L.refresh_basis(states[k], conv[k](delta), 3)
        L.lowrank_step(params[k], conv[k](grads), states[k], lr=0.01, step=4, config=cfg)
    np.testing.assert_allclose(params["torch"].numpy(), params["np"], rtol=1e-10, atol=1e-12)
    # LAPACK drivers may flip singular-vector signs: compare sign-free quantities.
    for key in ("exp_avg_sq", "error"):
        np.testing.assert_allclose(states["torch"][key].numpy(), states["np"][key], rtol=1e-9, atol=1e-12)
    moments = {k: L.back(states[k]["basis"], states[k]["exp_avg"], shape) for k in states}
    np.testing.assert_allclose(moments["torch"].numpy(), moments["np"], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("shape", [(5, 11), (11, 5)])
def test_refresh_within_the_same_subspace_preserves_the_first_moment(shape):
    rng = np.random.default_rng(2)
    r = 3
    state = L.init_lowrank_state(np.zeros(shape), r, error_feedback=False)
    d = min(shape)
    state["basis"][...] = np.linalg.qr(rng.standard_normal((d, r)))[0]
    state["exp_avg"][...] = rng.standard_normal(state["exp_avg"].shape)
    before = L.back(state["basis"], state["exp_avg"], shape)
    # Δ whose top-r subspace is span(old basis), with another orthonormal frame of it.
    mix = np.linalg.qr(rng.standard_normal((r, r)))[0]
    frame = state["basis"] @ mix
    other = rng.standard_normal((max(shape), r))
    delta = frame @ np.diag([3.0, 2.0, 1.0]) @ other.T if shape[0] <= shape[1] else \
        other @ np.diag([3.0, 2.0, 1.0]) @ frame.T
    report = L.refresh_basis(state, delta, r)
    assert report.similarity == pytest.approx(1.0, abs=1e-12)
    assert report.numerical_rank == r
    np.testing.assert_allclose(L.back(state["basis"], state["exp_avg"], shape), before, atol=1e-12)
    assert (state["exp_avg_sq"] >= 0).all()


def test_orthogonal_refresh_has_zero_similarity():
    old = np.eye(6)[:, :2]
    new = np.eye(6)[:, 2:4]
    assert L.subspace_similarity(new, old) == 0.0
    assert L.subspace_similarity(old, old) == pytest.approx(1.0)


@pytest.mark.parametrize("omega", [1.0, 0.9])
def test_stagnation_on_one_rank(omega):
    model = make_model()
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=3, sync_every=4, omega=omega, weight_decay=0.0)
    train(model, opt, 24)
    sims = [s for d in opt.diagnostics[1:] for s in d["similarity"].values()]
    ranks = [r for d in opt.diagnostics[1:] for r in d["rank"].values()]
    assert len(opt.diagnostics) == 6 and len(sims) == 5 * 2
    if omega == 1.0:
        assert min(sims) > 1 - 1e-4 and max(ranks) <= 3
    else:
        assert max(sims) < 0.99 and min(ranks) > 3


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_array_schedule_matches_the_torch_optimizer(kind):
    model, twin = make_model(), make_model()
    kw = {"rank": 3, "omega": 0.9, "sync_states": ("moments", "error_feedback")}
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, sync_every=4, **kw)
    conv = (lambda t: t.detach().numpy().copy()) if kind == "numpy" else (lambda t: t.detach())
    arrays = [(n, conv(p)) for n, p in twin.named_parameters()]
    sched = L.LoRDO(arrays, LoRDOConfig(**kw), LocalSyncConfig(sync_every=4))
    g = torch.Generator().manual_seed(0)
    for _ in range(9):
        x = torch.randn(8, 12, generator=g)
        y = torch.stack([x[:, :4].sum(1).sin(), x[:, 4:].prod(1).tanh()], 1)
        for m in (model, twin):
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        with torch.no_grad():
            sched.step({n: conv(p.grad) for n, p in twin.named_parameters()}, lr=1e-2)
            if kind == "numpy":
                for (n, a), p in zip(arrays, twin.parameters()):
                    p.copy_(torch.from_numpy(a))
    tol = {"rtol": 1e-5, "atol": 1e-6} if kind == "numpy" else {"rtol": 0, "atol": 0}
    for (n, a), p in zip(arrays, model.parameters()):
        np.testing.assert_allclose(np.asarray(a), p.detach().numpy(), **tol, err_msg=n)
    assert len(sched.diagnostics) == len(opt.diagnostics) == 2


def test_state_memory_follows_the_low_rank_formula():
    model = make_model()
    r = 3
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=r, error_feedback=False, outer_momentum=0.0)
    adam = hvd.DiLoCo(make_model().named_parameters(), lr=1e-2)
    P = sum(p.numel() for p in model.parameters())
    expect = 0
    for p in model.parameters():
        s = tuple(p.shape)
        expect += L.lowrank_state_values(s, r, error_feedback=False) if L.is_projected(s, r) else 2 * p.numel()
    assert opt.state_bytes() == 4 * (expect + P)  # + the reference weights
    assert adam.state_bytes() == 4 * (2 * P + 2 * P)  # Adam moments + reference + outer momentum
    assert opt.state_bytes() < adam.state_bytes()


def test_low_rank_adam_refreshes_its_basis_from_the_gradient():
    model = make_model()
    opt = hvd.LowRankAdam(model.parameters(), lr=1e-2, rank=3, refresh_every=4)
    train(model, opt, 13)
    assert len(opt.diagnostics) == 3  # refreshes at steps 5, 9, 13
    basis = opt.state[model[2].weight]["basis"]
    np.testing.assert_allclose((basis.T @ basis).numpy(), np.eye(3), atol=1e-5)
    with pytest.raises(ValueError, match="refresh_every=0"):
        hvd.LowRankAdam(model.parameters(), rank=3, refresh_every=0)


def test_load_state_dict_rejects_a_foreign_checkpoint():
    model = make_model()
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=3)
    with pytest.raises(ValueError, match="no 'commwire' entry"):
        opt.load_state_dict(torch.optim.Adam(model.parameters()).state_dict())


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: ~30 s on 2 cores
def test_mpi_suite(n):
    run_mpi_pytest(n, "tests/lordo/mpi_lordo.py", timeout=240)
