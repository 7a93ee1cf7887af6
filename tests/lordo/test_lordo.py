"""LoRDO / DiLoCo / LocalSync (the learning-rate sweep's tests: test_lordo_bench.py).

Tiers: tier 1 (this file, one process): the update rule against an
independent float64 re-statement written here (``reference_run``), the
fixed-basis displacement with and without error feedback, memory and byte
accounting, clipping, the warm-up and beta switch, checkpoints, numpy/torch
agreement, stagnation at ω = 1, bad input. Tier 2
(``mpi_lordo.py`` under mpiexec, 2 ranks; 4 ranks marked slow): identical
projections, warm-up weights identical on every rank, bytes against the
counters, resume. Tier 3 (CUDA, skipped without a device): every state
tensor on the parameter's device.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from mpi_helpers import run_mpi_pytest

torch = pytest.importorskip("torch")

import commwire as cw  # noqa: E402
import commwire.torch as hvd  # noqa: E402
from commwire.optim import lordo as L  # noqa: E402
from commwire.schedules import LocalSyncConfig, LoRDOConfig, LoRDOSchedule  # noqa: E402

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


def counted_bytes() -> int:
    return sum(v["bytes"] for k, v in cw.stats().items() if k != "codecs" and isinstance(v, dict))


# ------------------------------------------------------------------ reference
def _top(delta: np.ndarray, r: int) -> np.ndarray:
    u, _, vh = np.linalg.svd(delta, full_matrices=False)
    return u[:, :r] if delta.shape[0] <= delta.shape[1] else vh[:r].T


def reference_run(params: dict, grad_fn, steps: int, *, r: int, K: int, lr: float, omega: float = 0.9,
                  betas=(0.9, 0.95), eps: float = 1e-8, wd: float = 1e-3, mu: float = 1.0, den: str = "scalar",
                  clip: float | None = 0.5, ef: str = "full", qh_uses_error: bool = False,
                  warmup: int = 0, switch_betas=None, reset: bool = False, lr_scale: float = 1.0,
                  basis: dict | None = None):
    """Restate the LoRDO local update on one rank in plain float64 numpy, step by step.

    ``qh_uses_error`` puts Ĝ + E in the QH term (a wrong rule: it re-applies past projection residuals).
    ``basis`` fixes the bases (no refresh). Returns the weights after every step.
    """
    th = {n: p.astype(np.float64).copy() for n, p in params.items()}
    ref = {n: p.copy() for n, p in th.items()}
    st = {}
    for n, p in th.items():
        if p.ndim == 2 and r < min(p.shape):
            m_, n_ = p.shape
            low = (r, n_) if m_ <= n_ else (m_, r)
            st[n] = {"u": np.zeros(low), "v": np.zeros(low), "E": np.zeros(p.shape),
                     "R": np.random.default_rng(m_ * 100_003 + n_).standard_normal((n_, r)) / np.sqrt(n_)}
        else:
            st[n] = {"m": np.zeros(p.shape), "v": np.zeros(p.shape)}
    history = []
    for t in range(1, steps + 1):
        G = grad_fn(t, th)
        s = 1.0 if clip is None else min(1.0, clip / (np.sqrt(sum((g ** 2).sum() for g in G.values())) + 1e-6))
        if t > warmup and warmup:
            b1, b2 = switch_betas or betas
            k = t - warmup
            c1 = 1 - (1 if reset else betas[0] ** warmup) * b1 ** k
            c2 = 1 - (1 if reset else betas[1] ** warmup) * b2 ** k
            rate = lr * lr_scale
            if k == 1 and reset:
                for d in st.values():
                    for key in ("u", "v", "m"):
                        if key in d:
                            d[key][...] = 0
        else:
            b1, b2 = betas
            c1, c2 = 1 - b1 ** t, 1 - b2 ** t
            rate = lr
        for n in th:
            Gh = s * G[n]
            d = st[n]
            if "u" in d:
                if t == 1:
                    d["Q"] = basis[n] if basis else _top(G[n], r)
                Q, left = d["Q"], th[n].shape[0] <= th[n].shape[1]
                A = Gh + d["E"]
                g = Q.T @ A if left else A @ Q
                resid = A - (Q @ g if left else g @ Q.T)
                if ef == "full":
                    d["E"] = resid
                elif ef == "lowrank":
                    P = np.linalg.qr(resid @ d["R"])[0]
                    d["R"] = resid.T @ P
                    d["E"] = P @ d["R"].T
                d["u"] = b1 * d["u"] + (1 - b1) * g
                d["v"] = b2 * d["v"] + (1 - b2) * g * g
                dn = np.sqrt(d["v"] / c2) + eps
                low = (d["u"] / c1) / dn
                low = Q @ low if left else low @ Q.T
                D = dn.mean() if den == "scalar" else (dn.mean(axis=0)[None, :] if left else dn.mean(axis=1)[:, None])
                qh = A if qh_uses_error else Gh  # A = Ĝ + E before this step's projection
                th[n] = th[n] - rate * omega * low - rate * (1 - omega) * qh / (mu * D)
            else:
                d["m"] = b1 * d["m"] + (1 - b1) * Gh
                d["v"] = b2 * d["v"] + (1 - b2) * Gh * Gh
                th[n] = th[n] - rate * (d["m"] / c1) / (np.sqrt(d["v"] / c2) + eps)
            th[n] = th[n] - rate * wd * th[n]
        if t % K == 0:
            for n in th:
                delta = ref[n] - th[n]  # one rank: the average is the local Δ; plain averaging keeps θ
                ref[n] = th[n].copy()
                d = st[n]
                if "u" in d and basis is None:
                    new = _top(delta, r)
                    T = new.T @ d["Q"]
                    left = th[n].shape[0] <= th[n].shape[1]
                    d["u"] = T @ d["u"] if left else d["u"] @ T.T
                    d["v"] = (T * T) @ d["v"] if left else d["v"] @ (T * T).T
                    d["Q"] = new
        history.append({n: x.copy() for n, x in th.items()})
    return history


def _problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {"a": rng.standard_normal((6, 9)), "b": rng.standard_normal((10, 7)), "bias": rng.standard_normal(5)}
    targets = {n: rng.standard_normal(p.shape) for n, p in params.items()}

    def grad_fn(t, th):  # a quadratic pull towards fixed targets, plus a step-dependent kick
        return {n: (th[n] - targets[n]) * (1 + 0.1 * np.sin(t + i)) for i, n in enumerate(th)}

    return params, grad_fn


def _engine_run(params, grad_fn, steps, *, K, lr, kind="numpy", **config):
    arrays = [(n, p.copy() if kind == "numpy" else torch.from_numpy(p.copy())) for n, p in params.items()]
    warm = {k: config.pop(k) for k in ("warmup", "switch_betas", "reset", "lr_scale") if k in config}
    cfg = LoRDOConfig(rank=config.pop("r"), warmup_steps=warm.get("warmup", 0),
                      switch_betas=warm.get("switch_betas"), switch_reset_moments=warm.get("reset", False),
                      switch_lr_scale=warm.get("lr_scale", 1.0), **config)
    opt = LoRDOSchedule(arrays, cfg, LocalSyncConfig(sync_every=K))
    history = []
    for t in range(1, steps + 1):
        th = {n: np.asarray(a) for n, a in arrays}
        g = grad_fn(t, th)
        opt.step({n: (v if kind == "numpy" else torch.from_numpy(v)) for n, v in g.items()}, lr=lr)
        history.append({n: np.asarray(a).copy() for n, a in arrays})
    return history, opt


REFERENCE_CASES = [
    {},
    {"qh_denominator": "broadcast"},
    {"error_feedback": "none", "mu": 2.0},
    {"error_feedback": "lowrank"},
    {"clip": None, "omega": 0.5},
    {"warmup": 4, "switch_betas": (0.999, 0.999), "reset": True, "lr_scale": 0.5},
    {"warmup": 4, "switch_betas": (0.99, 0.9)},
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_update_rule_matches_the_reference(case, kind):
    params, grad_fn = _problem()
    cfg = {"r": 2, "omega": 0.9, "weight_decay": 1e-3, **case}
    ref_kw = {"omega": cfg["omega"], "wd": cfg["weight_decay"], "den": cfg.get("qh_denominator", "scalar"),
              "ef": cfg.get("error_feedback", "full"), "mu": cfg.get("mu", 1.0), "clip": cfg.get("clip", 0.5),
              **{k: case[k] for k in ("warmup", "switch_betas", "reset", "lr_scale") if k in case}}
    expect = reference_run(params, grad_fn, 12, r=2, K=4, lr=0.05, **ref_kw)
    got, _ = _engine_run(params, grad_fn, 12, K=4, lr=0.05, kind=kind, **cfg)
    for t, (e, g) in enumerate(zip(expect, got), 1):
        for n in params:
            np.testing.assert_allclose(g[n], e[n], rtol=1e-9, atol=1e-11, err_msg=f"{n} after step {t}")


@pytest.mark.parametrize("shape", [(8, 12), (12, 8)])
def test_fixed_basis_displacement_is_the_same_with_and_without_error_feedback(shape):
    # With Ĝ + E in the QH term, a constant out-of-subspace gradient would move θ (K+1)/2 times
    # as far after K steps; the QH term uses Ĝ alone, so error feedback must not change it.
    K, r, rng = 16, 2, np.random.default_rng(3)
    G = rng.standard_normal(shape)
    Q = np.linalg.qr(rng.standard_normal((min(shape), r)))[0]
    out = (lambda x: x - Q @ (Q.T @ x)) if shape[0] <= shape[1] else (lambda x: x - (x @ Q) @ Q.T)
    w0 = rng.standard_normal(shape)
    moved = {}
    for ef in L.ERROR_FEEDBACK:
        cfg = LoRDOConfig(rank=r, omega=0.9, clip=None, weight_decay=0.0, error_feedback=ef)
        w, state = w0.copy(), L.init_lowrank_state(w0, r, error_feedback=ef)
        state["basis"][...] = Q
        for t in range(1, K + 1):
            L.lowrank_step(w, G, state, lr=0.01, config=cfg, phase=cfg.phase(t))
        moved[ef] = np.linalg.norm(out(w - w0))
    assert moved["none"] > 0
    for ef in ("full", "lowrank"):
        assert moved[ef] == pytest.approx(moved["none"], rel=0.05), moved
    # The reference with the reported rule reproduces the (K+1)/2 blow-up that this test would catch.
    params, grad_fn = {"w": w0}, (lambda t, th: {"w": G})
    kw = {"r": r, "K": 10 ** 6, "lr": 0.01, "omega": 0.9, "wd": 0.0, "clip": None, "basis": {"w": Q}}
    fixed = reference_run(params, grad_fn, K, **kw)[-1]["w"]
    wrong = reference_run(params, grad_fn, K, qh_uses_error=True, **kw)[-1]["w"]
    assert np.linalg.norm(out(fixed - w0)) == pytest.approx(moved["full"], rel=1e-9)
    assert np.linalg.norm(out(wrong - w0)) / moved["none"] == pytest.approx((K + 1) / 2, rel=0.05)


# --------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    ({"sync_every": 0}, "sync_every=0"),
    ({"sync_every": -3}, "sync_every=-3"),
    ({"sync_every": 2.5}, "sync_every=2.5"),
    ({"omega": 1.5}, "omega=1.5"),
    ({"omega": -0.1}, "omega=-0.1"),
    ({"rank": 0}, "rank=0"),
    ({"sync_states": ("adam",)}, "unknown"),
    ({"error_feedback": False, "sync_states": ("error_feedback",)}, "error_feedback='none'"),
    ({"error_feedback": "lowrank", "sync_states": ("error_feedback",)}, "error_feedback='lowrank'"),
    ({"error_feedback": "half"}, "error_feedback='half'"),
    ({"qh_denominator": "max"}, "qh_denominator='max'"),
    ({"mu": 0.0}, "mu=0.0"),
    ({"clip": 0.0}, "clip=0.0"),
    ({"warmup_steps": 6, "sync_every": 4}, "warmup_steps=6 must be a multiple of sync_every=4"),
    ({"warmup_steps": -1}, "warmup_steps=-1"),
    ({"switch_betas": (0.999, 0.999)}, "warmup_steps=0"),
    ({"warmup_steps": 4, "sync_every": 4, "switch_betas": (0.9, 1.0)}, "switch_betas"),
    ({"warmup_steps": 4, "sync_every": 4, "switch_lr_scale": 0.0}, "switch_lr_scale=0.0"),
    ({"outer_momentum": 1.0}, "outer_momentum=1.0"),
    ({"lr": 0.0}, "lr=0.0"),
])
def test_bad_input_raises_naming_the_value(kwargs, match):
    args = {"lr": 1e-2, "rank": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        hvd.LoRDO(make_model().named_parameters(), **args)


def test_param_groups_with_their_own_betas_are_refused():
    model = make_model()
    groups = [{"params": list(model[0].parameters()), "betas": (0.8, 0.9)}, {"params": list(model[2].parameters())}]
    with pytest.raises(ValueError, match="betas=\\(0.8, 0.9\\)"):
        hvd.LoRDO(groups, lr=1e-2, rank=3)


def test_configs_are_frozen_and_validate():
    cfg = LocalSyncConfig(sync_every=8)
    with pytest.raises(AttributeError):
        cfg.sync_every = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="sync_every=True"):
        LocalSyncConfig(sync_every=True)
    with pytest.raises(ValueError, match="betas"):
        LoRDOConfig(rank=2, betas=(0.9, 1.0))
    assert LoRDOConfig(rank=2, error_feedback=True).error_feedback == "full"
    assert LoRDOConfig(rank=2, error_feedback=False).error_feedback == "none"


# ----------------------------------------------------------- clip, phases
def test_clipping_is_on_by_default_at_the_authors_max_norm():
    assert LoRDOConfig(rank=2).clip == 0.5
    model = make_model()
    assert hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=3).config.clip == 0.5


def test_clipping_uses_the_global_norm_of_all_gradients():
    # Clipping inside LoRDO equals torch's clip_grad_norm_ followed by LoRDO without clipping.
    a, b = make_model(), make_model()
    opt_a = hvd.LoRDO(a.named_parameters(), lr=1e-2, rank=3, sync_every=4, clip=0.05)
    opt_b = hvd.LoRDO(b.named_parameters(), lr=1e-2, rank=3, sync_every=4, clip=None)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        x = torch.randn(8, 12, generator=g)
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            (100 * m(x).square().mean()).backward()
            if opt is opt_b:
                norm = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
                assert norm > 0.05  # clipping is active
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_phase_switches_betas_resets_bias_correction_and_scales_lr():
    cfg = LoRDOConfig(rank=2, warmup_steps=8, warmup_omega=1.0, switch_betas=(0.999, 0.999),
                      switch_reset_moments=True, switch_lr_scale=0.5)
    early, first, later = cfg.phase(8), cfg.phase(9), cfg.phase(12)
    assert early.warmup and early.betas == (0.9, 0.95) and early.omega == 1.0 and early.lr_scale == 1.0
    assert early.bias == pytest.approx((1 - 0.9 ** 8, 1 - 0.95 ** 8))
    assert not first.warmup and first.starts and first.betas == (0.999, 0.999) and first.omega == 0.97
    assert first.bias == pytest.approx((1 - 0.999, 1 - 0.999)) and first.lr_scale == 0.5
    assert not later.starts and later.bias == pytest.approx((1 - 0.999 ** 4,) * 2)
    keep = LoRDOConfig(rank=2, warmup_steps=8, switch_betas=(0.99, 0.999))
    assert keep.phase(10).bias == pytest.approx((1 - 0.9 ** 8 * 0.99 ** 2, 1 - 0.95 ** 8 * 0.999 ** 2))


def test_warmup_sends_gradients_not_pseudo_gradients_and_resets_moments_at_the_switch():
    model = make_model()
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=3, sync_every=4, warmup_steps=8,
                    switch_betas=(0.999, 0.999), switch_reset_moments=True, sync_states=())
    P = sum(p.numel() for p in model.parameters())
    cw.stats(reset=True)
    train(model, opt, 8)
    assert counted_bytes() == opt.stats()["bytes"]["sent"] == 8 * 4 * P  # one gradient all-reduce per step
    assert opt._sync.syncs == 0 and len(opt.diagnostics) == 2  # two refreshes, no message
    train(model, opt, 1, seed=5)
    # Right after the reset each moment holds one gradient: u = (1 − b1) g and v = (1 − b2) g²,
    # so v = u² (1 − b2) / (1 − b1)² (with history, v would be larger than that).
    for p in model.parameters():
        u, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
        assert v.abs().sum() > 0
        torch.testing.assert_close(v, u * u * (1 - 0.999) / (1 - 0.999) ** 2, rtol=1e-4, atol=1e-12)
    train(model, opt, 3, seed=6)
    assert counted_bytes() == opt.stats()["bytes"]["sent"] == 8 * 4 * P + opt.bytes_per_sync
    assert opt._sync.syncs == 1


# ---------------------------------------------------------- memory, bytes
@pytest.mark.parametrize("ef", ["none", "lowrank", "full"])
def test_optimizer_memory_follows_the_formula(ef):
    r = 3
    model = make_model()
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=r, error_feedback=ef)
    train(model, opt, 2)
    mem = opt.stats()["memory"]
    P = sum(p.numel() for p in model.parameters())
    expect = 0
    for p in model.parameters():
        s = tuple(p.shape)
        per = L.lowrank_state_values(s, r, error_feedback=ef) if L.is_projected(s, r) else 2 * p.numel()
        assert sum(v.numel() for v in opt.state[p].values()) == per
        expect += per
    assert mem["total"] - mem["reference"] == 4 * expect
    assert mem["reference"] == 4 * P and mem["outer_momentum"] == 0
    assert mem["total"] == opt.state_bytes()
    assert (mem["error_feedback"] > 0) == (ef != "none")


def test_low_rank_state_is_o_r_m_plus_n_without_a_full_error_buffer():
    m, n, r = 256, 512, 8
    for ef, bound in (("none", 3 * r * (m + n)), ("lowrank", 4 * r * (m + n))):
        values = L.lowrank_state_values((m, n), r, error_feedback=ef)
        assert values == 2 * r * n + r * m + (r * (m + n) if ef == "lowrank" else 0) <= bound
        state = L.init_lowrank_state(np.zeros((m, n), np.float32), r, error_feedback=ef)
        assert sum(v.size for v in state.values()) == values
    assert L.lowrank_state_values((m, n), r, error_feedback="full") > m * n  # the full buffer alone is mn


def test_stats_bytes_match_the_counters_on_one_rank():
    model = make_model()
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=3, sync_every=4, sync_states=("moments",))
    cw.stats(reset=True)
    train(model, opt, 9)
    s = opt.stats()["bytes"]
    assert s["sent"] == counted_bytes() == s["bootstrap"] + 2 * s["per_sync"]
    assert s["bootstrap"] == 4 * sum(p.numel() for n, p in model.named_parameters() if n in opt.projected_names)
    assert s["per_step"] == s["per_sync"] / 4 and s["syncs"] == 2 and s["steps"] == 9


def test_lowrank_error_feedback_is_the_power_step_approximation():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((10, 14))
    state = L.init_lowrank_state(w, 3, error_feedback="lowrank")
    assert set(state) == {"basis", "exp_avg", "exp_avg_sq", "error_p", "error_r"}
    x = rng.standard_normal((10, 3)) @ rng.standard_normal((3, 14))  # rank 3: one power step recovers it
    L._store_error(state, x)
    np.testing.assert_allclose(state["error_p"] @ state["error_r"].T, x, atol=1e-10)
    np.testing.assert_allclose(state["error_p"].T @ state["error_p"], np.eye(3), atol=1e-12)


# ------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("options", [{}, {"error_feedback": "lowrank", "qh_denominator": "broadcast"},
                                     {"warmup_steps": 4, "switch_betas": (0.999, 0.999),
                                      "switch_reset_moments": True, "outer_momentum": 0.5}])
def test_state_dict_round_trip_continues_identically(options):
    def build():
        model = make_model()
        return model, hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=3, sync_every=4, **options)

    model, opt = build()
    train(model, opt, 6)  # mid-period (and, with a warm-up, just after the switch)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    train(model, opt, 7, seed=1)
    model2, opt2 = build()
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(model2, opt2, 7, seed=1)
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), name
    assert opt.diagnostics == opt2.diagnostics and opt.stats() == opt2.stats()


def test_commwire_checkpoint_round_trip(tmp_path):
    model = make_model()
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=3, sync_every=4, error_feedback="lowrank")
    train(model, opt, 5)
    cw.checkpoint.save(str(tmp_path / "ck"), {"model": model, "opt": opt})
    train(model, opt, 5, seed=2)
    model2 = make_model()
    opt2 = hvd.LoRDO(model2.named_parameters(), lr=1e-2, rank=3, sync_every=4, error_feedback="lowrank")
    cw.checkpoint.load(str(tmp_path / "ck"), {"model": model2, "opt": opt2})
    train(model2, opt2, 5, seed=2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_array_engine_state_dict_round_trip():
    params, grad_fn = _problem(1)
    hist, opt = _engine_run(params, grad_fn, 6, K=4, lr=0.05, r=2)
    saved = opt.state_dict()
    arrays = [(n, hist[-1][n].copy()) for n in params]
    twin = LoRDOSchedule(arrays, LoRDOConfig(rank=2), LocalSyncConfig(sync_every=4))
    twin.load_state_dict(saved)
    for t in range(7, 10):
        g = grad_fn(t, {n: a for n, a in opt.params})
        opt.step(g, lr=0.05)
        twin.step(grad_fn(t, dict(arrays)), lr=0.05)
    for (n, a), (_, b) in zip(opt.params, arrays):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="same rank and error_feedback"):
        LoRDOSchedule([(n, params[n].copy()) for n in params], LoRDOConfig(rank=2, error_feedback="none"),
                      LocalSyncConfig(sync_every=4)).load_state_dict(saved)


def test_load_state_dict_rejects_a_foreign_checkpoint():
    model = make_model()
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=3)
    with pytest.raises(ValueError, match="no 'commwire' entry"):
        opt.load_state_dict(torch.optim.Adam(model.parameters()).state_dict())


# --------------------------------------------------- devices, dtypes, math
def _check_state_placement(opt, model):
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert value.device == p.device and value.dtype == p.dtype, (key, value.device, value.dtype)
    for x in list(opt._sync.reference.values()) + list(opt._sync.momentum.values()):
        assert x.device == next(model.parameters()).device


@pytest.mark.parametrize("ef", L.ERROR_FEEDBACK)
def test_every_state_tensor_has_the_parameters_dtype_and_device(ef):
    model = make_model().double()
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=3, sync_every=2, error_feedback=ef, outer_momentum=0.5)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 12, generator=g, dtype=torch.float64)).square().mean().backward()
        opt.step()
    _check_state_placement(opt, model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("ef", L.ERROR_FEEDBACK)
def test_state_stays_on_the_cuda_device(ef):
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    model = make_model().to(dev)
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=3, sync_every=2, error_feedback=ef, warmup_steps=2,
                    outer_momentum=0.5)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 12, device=dev)).square().mean().backward()
        opt.step()
    _check_state_placement(opt, model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_rank_at_least_the_smaller_dimension_falls_back_to_full_rank():
    model = make_model()
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, rank=12)
    # 16 x 12 and 2 x 24 have min dim <= 12: full-rank Adam; 24 x 16 is projected.
    assert opt.projected_names == ["2.weight"]
    assert "basis" not in opt.state[model[0].weight]
    assert opt.state[model[0].weight]["exp_avg"].shape == (16, 12)
    train(model, opt, 5)
    assert all(torch.isfinite(p).all() for p in model.parameters())


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
        assert max(sims) < 0.999 and min(ranks) > 3


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_array_schedule_matches_the_torch_optimizer(kind):
    model, twin = make_model(), make_model()
    kw = {"rank": 3, "omega": 0.9, "sync_states": ("moments", "error_feedback"), "warmup_steps": 4,
          "switch_betas": (0.99, 0.999)}
    opt = hvd.LoRDO(model.named_parameters(), lr=1e-2, sync_every=4, **kw)
    conv = (lambda t: t.detach().numpy().copy()) if kind == "numpy" else (lambda t: t.detach())
    arrays = [(n, conv(p)) for n, p in twin.named_parameters()]
    sched = LoRDOSchedule(arrays, LoRDOConfig(**kw), LocalSyncConfig(sync_every=4))
    g = torch.Generator().manual_seed(0)
    for _ in range(13):
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
    assert len(sched.diagnostics) == len(opt.diagnostics) == 3


def test_low_rank_adam_refreshes_its_basis_from_the_gradient():
    model = make_model()
    opt = hvd.LowRankAdam(model.parameters(), lr=1e-2, rank=3, refresh_every=4)
    train(model, opt, 13)
    assert len(opt.diagnostics) == 3  # refreshes at steps 5, 9, 13
    basis = opt.state[model[2].weight]["basis"]
    np.testing.assert_allclose((basis.T @ basis).numpy(), np.eye(3), atol=1e-5)
    with pytest.raises(ValueError, match="refresh_every=0"):
        hvd.LowRankAdam(model.parameters(), rank=3, refresh_every=0)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])  # 3: several peers, not a power of two (4 processes: ~25-40 s on 2 cores)
def test_mpi_suite(n):
    run_mpi_pytest(n, "tests/lordo/mpi_lordo.py", timeout=300)
