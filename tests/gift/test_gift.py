"""GIFT stage and its torch hooks in one process — tier 1 (tier 2: test_mpi.py runs mpi_gift.py).

Tolerances: exact algebra is checked in float64 to 1e-10 relative; the float32
path of tensor_forward/tensor_inverse to 1e-5 relative.
"""

from __future__ import annotations


import numpy as np
import pytest

from commwire import codecs
from commwire.codecs.gift import Gift, GiftConfig, factor_from_gram


def _gram(d: int, seed: int = 0, rows: int = 4000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, d)) * np.geomspace(30.0, 0.01, d)
    return x.T @ x / rows


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _ready(spec: str = "gift:rank=8+fp8-e4m3", d: int = 32, names=("a.weight", "b.weight")) -> Gift:
    codec = codecs.get(spec)
    for i, name in enumerate(names):
        codec.observe(name, _gram(d, seed=i) * 100, 100)
    codec.refresh()
    return codec


# ------------------------------------------------------------------ the factor
def test_full_factor_squares_to_damped_statistics():
    a = _gram(24)
    f = factor_from_gram(a, rank=0, damping=1e-3)
    damped = a + 1e-3 * np.trace(a) / 24 * np.eye(24)
    s = f.matrix()
    assert _rel(s @ s.T, damped) < 1e-10
    # the scale c = sqrt(tr A / tr(A S⁻²)) keeps the whitened gradient's size on average
    c = np.sqrt(np.trace(a) / np.trace(a @ np.linalg.inv(damped)))
    assert abs(f.scale - c) < 1e-10 * c and f.scale > 1.0
    w = np.random.default_rng(1).standard_normal((7, 24))
    assert _rel(f.forward(w), c * w @ np.linalg.inv(s).T) < 1e-10
    assert _rel(f.inverse(f.forward(w)), w) < 1e-12
    plain = factor_from_gram(a, rank=0, damping=1e-3, normalise=False)
    assert plain.scale == 1.0 and _rel(plain.forward(w), w @ np.linalg.inv(s).T) < 1e-10


def test_unknown_gift_option_is_refused_by_name():
    with pytest.raises(ValueError, match=r"gift options \['primal'\] are not spec options"):
        codecs.get("gift:primal=1,ef=0+fp8-e4m3")


def test_spec_without_quantisation_is_exact():
    lossless = Gift(codecs.get("none"), rank=4, ef=False)
    lossless.observe("w", _gram(16) * 50, 50)
    lossless.refresh()
    x = np.random.default_rng(4).standard_normal(5 * 16).astype(np.float32)
    y = lossless.tensor_forward(x, "w")
    np.testing.assert_allclose(y.reshape(5, 16), lossless.factors()["w"].forward(x.reshape(5, 16).astype(np.float64)),
                               rtol=1e-5, atol=1e-6)
    out = y.copy()
    lossless.tensor_inverse(out, "w")
    np.testing.assert_allclose(out, x, rtol=1e-4, atol=1e-5)


def test_low_rank_equals_full_when_statistics_are_rank_r_plus_isotropic():
    rng = np.random.default_rng(2)
    d, r = 40, 6
    u, _ = np.linalg.qr(rng.standard_normal((d, r)))
    a = u @ np.diag(np.geomspace(100.0, 5.0, r)) @ u.T + 0.3 * (np.eye(d) - u @ u.T)
    low = factor_from_gram(a, rank=r, damping=1e-3).matrix()
    full = factor_from_gram(a, rank=0, damping=1e-3).matrix()
    assert _rel(low, full) < 1e-10
    # rank = d is the full factor, and on generic statistics rank r < d is only an approximation
    assert _rel(factor_from_gram(a, rank=d, damping=1e-3).matrix(), full) < 1e-10
    generic = _gram(d)
    assert _rel(factor_from_gram(generic, rank=r, damping=1e-3).matrix(),
                factor_from_gram(generic, rank=0, damping=1e-3).matrix()) > 1e-3


def test_shared_transform_commutes_with_the_sum_and_different_ones_do_not():
    rng = np.random.default_rng(3)
    f = factor_from_gram(_gram(16), rank=4, damping=1e-3)
    other = factor_from_gram(_gram(16, seed=9), rank=4, damping=1e-3)
    ws = [rng.standard_normal((5, 16)) for _ in range(4)]
    total = sum(ws)
    assert _rel(f.inverse(sum(f.forward(w) for w in ws)), total) < 1e-12
    mixed = [f, other, f, other]
    assert _rel(f.inverse(sum(t.forward(w) for t, w in zip(mixed, ws))), total) > 1e-2


def test_rank_larger_than_width_is_refused():
    with pytest.raises(ValueError, match=r"rank=33 is larger than the input width 32 of layer 'x'"):
        factor_from_gram(_gram(32), rank=33, damping=1e-3, name="x")
    codec = codecs.get("gift:rank=64+fp8-e4m3")
    with pytest.raises(ValueError, match=r"rank=64 .* width 32 of layer 'fc.weight'"):
        codec.observe("fc.weight", _gram(32), 10)


def test_non_finite_statistics_warn_and_keep_the_previous_factor():
    codec = _ready()
    before = codec.factors()["a.weight"]
    bad = _gram(32)
    bad[3, 4] = np.nan
    codec.observe("a.weight", bad, 10)
    with pytest.warns(RuntimeWarning, match=r"'a.weight' hold 1 non-finite"):
        codec.refresh()
    assert codec.factors()["a.weight"] is not before
    np.testing.assert_array_equal(codec.factors()["a.weight"].u, before.u)


def test_singular_statistics_are_damped_with_a_warning():
    x = np.random.default_rng(4).standard_normal((5, 20))
    with pytest.warns(RuntimeWarning, match=r"singular \(numerical rank 5 of 20\)"):
        f = factor_from_gram(x.T @ x, rank=0, damping=1e-2, name="lin")
    assert np.all(np.isfinite(f.matrix())) and np.all(f.lam > 0) and f.sigma > 0
    with pytest.warns(RuntimeWarning, match="all zero"):
        assert factor_from_gram(np.zeros((4, 4)), rank=2, damping=1e-3) is None


@pytest.mark.parametrize("bad", [dict(rank=-1), dict(refresh=0), dict(damping=0.0), dict(damping=2.0),
                                 dict(ef=1), dict(layers="a.weight"), dict(layers=("a",), profile=5)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="GiftConfig"):
        GiftConfig(**bad)


def test_unknown_layers_in_the_list_are_named():
    codec = Gift(codecs.get("fp8-e4m3"), layers=("a.weight", "nope.weight"))
    codec.observe("narrow.weight", _gram(8), 10)  # not listed: narrower than rank=32 is fine
    with pytest.raises(ValueError, match=r"rank=32 is larger than the input width 8 of layer 'a.weight'"):
        codec.observe("a.weight", _gram(8), 10)
    codec.observe("a.weight", _gram(40), 10)
    with pytest.raises(ValueError, match=r"\['nope.weight'\] are not known weight matrices"):
        codec.refresh()


def test_spec_round_trips_and_wire_size_is_the_inner_codecs():
    for spec in ("gift+fp8-e4m3", "gift:rank=16,refresh=10,ef=0+nvfp4", "ef+gift:rank=0+fp8-e5m2:block=128"):
        codec = codecs.get(spec)
        assert codecs.get(codec.spec).spec == codec.spec == spec
        inner = codecs.get(spec.split("+", 2)[-1] if spec.startswith("ef+") else spec.split("+", 1)[1])
        assert codec.wire_nbytes(1000) == inner.wire_nbytes(1000)
    with pytest.raises(ValueError, match="ef=2"):
        codecs.get("gift:ef=2+fp8-e4m3")


# ------------------------------------------------------------------ whole tensors and buckets
def test_bucket_forward_inverse_is_exact_and_leaves_other_tensors_alone():
    codec = _ready()
    rng = np.random.default_rng(5)
    layout = [("a.bias", 0, (7,)), ("a.weight", 7, (6, 32)), ("emb.weight", 199, (4, 32)), ("b.weight", 327, (3, 32))]
    codec.bind_layout("bucket0", layout)
    x = rng.standard_normal(327 + 96).astype(np.float32)
    original = x.copy()
    y = codec.tensor_forward(x, "bucket0")
    np.testing.assert_array_equal(x, original)  # the input is never modified
    np.testing.assert_array_equal(y[:7], x[:7])
    np.testing.assert_array_equal(y[199:327], x[199:327])
    f = codec.factors()["a.weight"]
    np.testing.assert_allclose(y[7:199].reshape(6, 32), f.forward(x[7:199].reshape(6, 32).astype(np.float64)),
                               rtol=1e-4, atol=1e-5 * np.abs(y).max())
    codec.tensor_inverse(y, "bucket0")
    assert _rel(y, original) < 1e-5


def test_one_step_round_trip_through_the_codec_is_accurate():
    codec = _ready("gift:rank=8+fp16")
    g = np.random.default_rng(6).standard_normal((10, 32)).astype(np.float32)
    y = codec.tensor_forward(g.ravel(), "a.weight")
    out = codec.decode(codec.encode(y, key="a.weight"))
    codec.tensor_inverse(out, "a.weight")
    assert _rel(out, g.ravel()) < 2e-3


def test_error_feedback_bounds_the_accumulated_error():
    g = (np.random.default_rng(7).standard_normal((16, 32)) * 1e-3).astype(np.float32).ravel()
    sums = {}
    for ef in (0, 1):
        codec = _ready(f"gift:rank=8,ef={ef}+nvfp4")
        total = np.zeros_like(g, dtype=np.float64)
        for _ in range(20):
            y = codec.tensor_forward(g, "a.weight")
            out = codec.decode(codec.encode(y, key="a.weight"))
            codec.tensor_inverse(out, "a.weight")
            total += out
        sums[ef] = _rel(total / 20, g.astype(np.float64))
    assert sums[1] < 0.3 * sums[0], sums


def test_residual_is_carried_across_a_refresh_in_original_coordinates():
    codec = _ready("gift:rank=8+fp8-e5m2")
    g = np.random.default_rng(8).standard_normal((9, 32)).astype(np.float32).ravel()
    y = codec.tensor_forward(g, "b.weight")
    codec.tensor_inverse(codec.decode(codec.encode(y, key="b.weight")), "b.weight")
    old = codec.factors()["b.weight"]
    before = old.inverse(codec.residual("b.weight").reshape(9, 32).astype(np.float64))
    assert np.abs(before).max() > 0
    codec.observe("b.weight", _gram(32, seed=42) * 50, 50)
    codec.refresh()
    new = codec.factors()["b.weight"]
    assert _rel(new.matrix(), old.matrix()) > 1e-2
    after = new.inverse(codec.residual("b.weight").reshape(9, 32).astype(np.float64))
    assert _rel(after, before) < 1e-5


def test_state_round_trips_and_an_unverified_checkpoint_is_refused():
    codec = _ready()
    g = np.random.default_rng(9).standard_normal((4, 32)).astype(np.float32).ravel()
    y = codec.tensor_forward(g, "a.weight")
    codec.tensor_inverse(codec.decode(codec.encode(y, key="a.weight")), "a.weight")
    saved = codec.state_dict()
    fresh = codecs.get(codec.spec)
    fresh.declare("a.weight", 32)
    fresh.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="not verified"):
        fresh.tensor_forward(g, "a.weight")
    fresh.verify()
    assert fresh.digest() == codec.digest()
    assert fresh.selection == codec.selection and fresh.version == codec.version
    np.testing.assert_array_equal(fresh.residual("a.weight"), codec.residual("a.weight"))
    np.testing.assert_array_equal(fresh.tensor_forward(g, "a.weight"), codec.tensor_forward(g, "a.weight"))


def test_fragility_profile_selects_the_layer_whose_values_underflow():
    codec = codecs.get("gift:rank=4,profile=3,top=1+fp8-e4m3")
    rng = np.random.default_rng(10)
    codec.bind_layout("bucket", [("ok.weight", 0, (8, 16)), ("weak.weight", 128, (8, 16))])
    for name in ("ok.weight", "weak.weight"):
        codec.observe(name, _gram(16), 10)
    for step in range(3):
        x = rng.standard_normal(256).astype(np.float32)
        x[128:] *= 1e-6  # one shared scale: these fall below half E4M3's smallest subnormal and flush
        codec.tensor_forward(x, "bucket")
        codec.encode(codec._live["bucket"].buffer, key="bucket")
        codec.tensor_inverse(x.copy(), "bucket")
        if step == 1:
            codec.refresh()
            assert codec.selection is None and not codec.factors()  # still profiling
    frag = codec.fragility()
    assert frag["weak.weight"] > 0.9 and frag["ok.weight"] < 0.1
    for name in ("ok.weight", "weak.weight"):
        codec.observe(name, _gram(16), 10)
    codec.refresh()
    assert codec.selection == ("weak.weight",) and list(codec.factors()) == ["weak.weight"]


# ------------------------------------------------------------------ torch hooks and the optimizer
torch = pytest.importorskip("torch")


def _mlp() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def test_hooks_collect_the_exact_second_moment_and_refresh_on_schedule():
    from commwire.torch.gift import GiftHooks, GiftHooksConfig

    model = _mlp()
    codec = codecs.get("gift:rank=4,refresh=3+fp8-e4m3")
    hooks = GiftHooks(model, codec, model.named_parameters(), config=GiftHooksConfig(window=2, max_rows=1000))
    assert sorted(hooks.layers) == ["0.weight", "2.weight"]
    seen, refreshed = [], []
    model[0].register_forward_hook(lambda m, i, o: seen.append(i[0].detach().double()))
    for step in range(1, 9):
        model(torch.randn(20, 12)).sum().backward()
        if hooks.after_step() is not None:
            refreshed.append(step)
            if step == 2:
                x = torch.cat(seen)
                expect = factor_from_gram((x.T @ x / len(x)).numpy(), rank=4, damping=1e-3)
                assert _rel(codec.factors()["0.weight"].matrix(), expect.matrix()) < 1e-5
    assert refreshed == [2, 5, 8]
    assert codec.version == 3 and hooks.steps == 8


def test_hooks_refuse_unknown_layers_and_models_without_linear_layers():
    from commwire.torch.gift import GiftHooks

    model = _mlp()
    codec = Gift(codecs.get("fp8-e4m3"), rank=4, layers=("0.weight", "9.weight"))
    with pytest.raises(ValueError, match=r"\['9.weight'\]"):
        GiftHooks(model, codec, model.named_parameters())
    conv = torch.nn.Conv1d(2, 2, 1)
    with pytest.raises(ValueError, match="no nn.Linear"):
        GiftHooks(conv, codecs.get("gift+fp8-e4m3"), conv.named_parameters())
    with pytest.raises(ValueError, match="has no GIFT stage"):
        GiftHooks(model, codecs.get("fp8-e4m3"), model.named_parameters())


def test_distributed_optimizer_wires_gift_on_one_rank():
    import commwire.torch as hvd

    hvd.init()
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="pass model="):
        hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                 compression=hvd.Compression.gift_fp8)
    codec = codecs.get("gift:rank=4,refresh=2+fp8-e4m3")
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=codec, model=model)
    x, y = torch.randn(32, 12), torch.randn(32, 4)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert codec.version >= 5 and set(codec.factors()) == {"0.weight", "2.weight"}
    assert losses[-1] < 0.8 * losses[0]
    state = opt.state_dict()
    opt.load_state_dict(state)  # verifies on the (single-rank) world
    assert hvd.Compression.gift_nvfp4 == "gift+nvfp4"
