"""Streaming DiLoCo (``DiLoCo(fragments=, fragment_sync_delay=, fragment_update_alpha=)``) — tier 1 (one process).

References: the setting of torchft's mocked regression test (``diloco_regression_test.py``:
sync_every 6, two fragments, inner SGD lr 1, outer SGD lr 2, gradient 2, weight 1), whose fixtures
land fragment 0 after steps 3, 9, 15 and fragment 1 after 6, 12 and hold −7 (τ = 1, α = 0), −6
(τ = 1, α = 0.5) and −11 (τ = 0) after step 3 (read from torchft's fixture files by hand, worked
again below; the α = 0.25 case is ours); plain DiLoCo for one fragment; a hand-written loop.
The 2-rank checks (the average over ranks on the background lane, FP32 and FP8; the bytes) are in
``mpi_lordo.py``.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import commwire as cw  # noqa: E402
import commwire.torch as hvd  # noqa: E402
from commwire.schedules import LocalSyncConfig, StreamingSync, split_fragments  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def world():
    return cw.init()


def make_model(seed: int = 0) -> torch.nn.Module:  # test_diloco.py's model, batches and loop
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


def test_schedule_lands_fragments_where_torchft_does():
    w = [("a", np.zeros(3)), ("b", np.zeros(3))]
    sched = StreamingSync(w, LocalSyncConfig(sync_every=6), fragments=2, delay=1)
    lands = {s: sched.lands(s) for s in range(1, 19) if sched.lands(s) is not None}
    begins = {s: sched.begins(s) for s in range(1, 19) if sched.begins(s) is not None}
    assert lands == {3: 0, 6: 1, 9: 0, 12: 1, 15: 0, 18: 1}
    assert begins == {2: 0, 5: 1, 8: 0, 11: 1, 14: 0, 17: 1}
    assert [s for s in range(1, 13) if sched.due(s)] == [2, 3, 5, 6, 8, 9, 11, 12]


class Mocked(torch.nn.Module):
    """Two one-element layers whose loss has gradient 2 everywhere (torchft's mocked model)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(1, 1, bias=False) for _ in range(2)])
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.fill_(1.0)

    def loss(self) -> torch.Tensor:
        return 2.0 * sum(layer.weight.sum() for layer in self.layers)


@pytest.mark.parametrize("delay,alpha,expected", [(1, 0.0, -7.0), (1, 0.5, -6.0), (0, 0.0, -11.0), (1, 0.25, -6.5)])
def test_mocked_updates_match_torchft_fixtures(delay, alpha, expected):
    model = Mocked()
    opt = hvd.DiLoCo(model.named_parameters(), sync_every=6, fragments=2, fragment_sync_delay=delay,
                     fragment_update_alpha=alpha, inner_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0),
                     outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=2.0))
    for _ in range(3):
        opt.zero_grad()
        model.loss().backward()
        opt.step()
    # By hand: w_s = 1 - 2s locally. Fragment 0 sends θ_ref - w at step 3 - τ (Δ = 2(3 - τ)), its new
    # θ_ref is 1 - 2Δ, and after step 3 (w = -5) it restarts from (1 - α)θ_ref + α(-5). Fragment 1 trains on.
    assert model.layers[0].weight.item() == expected
    assert model.layers[1].weight.item() == -5.0
    assert opt._sync.reference["layers.0.weight"].item() == (-7.0 if delay else -11.0)
    assert opt._sync.reference["layers.1.weight"].item() == 1.0


def test_one_fragment_without_delay_is_plain_diloco():
    base, stream = make_model(), make_model()
    a = hvd.DiLoCo(base.named_parameters(), lr=1e-2, sync_every=4)
    b = hvd.DiLoCo(stream.named_parameters(), lr=1e-2, sync_every=4, fragment_update_alpha=0.0,
                   fragments=[[n for n, _ in stream.named_parameters()]])
    assert isinstance(b._sync, StreamingSync) and b.fragments == a.fragments
    train(base, a, range(13))
    train(stream, b, range(13))
    for p, q in zip(base.parameters(), stream.parameters()):
        assert torch.equal(p, q)
    assert a.bytes_per_sync == b.bytes_per_sync and a.bytes_per_step == b.bytes_per_step


@pytest.mark.parametrize("outer", ["built-in", "factory", "model"])
def test_fragments_match_a_hand_written_loop(outer):
    H, P, tau, alpha = 6, 3, 1, 0.25
    model, ref = make_model(), make_model()
    given = {"built-in": None, "factory": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
             "model": torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)}[outer]
    opt = hvd.DiLoCo(model.named_parameters(), sync_every=H, fragments=P, fragment_sync_delay=tau,
                     fragment_update_alpha=alpha, outer_optimizer=given,
                     inner_optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    steps = range(3 * H + 2)
    train(model, opt, steps)
    # By hand: the fragments cut 48, 8, 16, 2 elements where the running total first reaches 1/3
    # and 2/3 of 74; fragment i lands after (i+1)·2 + 6k, sent one step before; one rank: Δ is local.
    frags = split_fragments(list(ref.named_parameters()), P)
    assert frags == [["0.weight"], ["0.bias"], ["2.weight", "2.bias"]] and opt.fragments == frags
    names = [n for n, _ in ref.named_parameters()]
    theta = {n: p.detach().clone() for n, p in ref.named_parameters()}
    anchor = {n: t.clone() for n, t in theta.items()}
    buf = {n: torch.zeros_like(t) for n, t in theta.items()}
    sent: dict[int, dict[str, torch.Tensor]] = {}
    for s in steps:
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(theta[n])
        ref.zero_grad()
        x, y = batch(s)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for n, p in ref.named_parameters():
            theta[n] -= 0.05 * p.grad
        step = s + 1
        for i, members in enumerate(frags):
            at = (i + 1) * (H // P)
            if (step - at + tau) % H == 0:
                sent[i] = {n: anchor[n] - theta[n] for n in members}
            if step >= at and (step - at) % H == 0:
                for n in members:
                    d = sent[i][n]
                    buf[n].mul_(0.9).add_(d)
                    anchor[n] -= 0.7 * (d + 0.9 * buf[n])
                    theta[n] = (1 - alpha) * anchor[n] + alpha * theta[n]
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), theta[n], rtol=1e-5, atol=1e-6, msg=n)
    assert names == [n for n, _ in model.named_parameters()]
    assert opt._sync.syncs == 10  # in 20 steps: fragment 0 after 2, 8, 14, 20; the others three times


def test_checkpoint_with_a_sync_in_flight_resumes_identically():
    def build():
        model = make_model()
        return model, hvd.DiLoCo(model.named_parameters(), lr=1e-2, sync_every=4, fragments=2,
                                 fragment_sync_delay=1, fragment_update_alpha=0.5, codec="ef+fp8-e4m3")

    model, opt = build()
    train(model, opt, range(5))  # fragment 1 began after step 3, lands after 4; fragment 0 began after 5
    assert opt._sync.parts[0].in_flight
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    train(model, opt, range(5, 14))
    model2, opt2 = build()
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert opt2._sync.parts[0].in_flight and not opt2._sync.parts[1].in_flight
    train(model2, opt2, range(5, 14))
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), name
    other = make_model()
    three = hvd.DiLoCo(other.named_parameters(), lr=1e-2, sync_every=6, fragments=3)
    with pytest.raises(ValueError, match="fragments differ"):
        three.load_state_dict(saved["opt"])


def test_peak_bytes_fall_with_the_fragments():
    model = make_model()
    whole = hvd.DiLoCo(model.named_parameters(), sync_every=8)
    four = hvd.DiLoCo(model.named_parameters(), sync_every=8, fragments=[["0.weight"], ["0.bias"], ["2.weight"],
                                                                        ["2.bias"]])
    assert four.bytes_per_step == whole.bytes_per_step == 4 * 74 / 8
    assert four.bytes_per_sync == 4 * 48 and whole.bytes_per_sync == 4 * 74
    assert four.values_per_sync == 48 and four._sync.messages_per_sync == 1


def _bad():
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    return [
        ({"fragments": 3, "sync_every": 8}, ValueError, "sync_every=8 is not a multiple of the 3 fragments"),
        ({"fragments": 5, "sync_every": 10}, ValueError, "fragments=5 is more than the 4 parameters"),
        ({"fragments": 0}, ValueError, "fragments"),
        ({"fragments": "2"}, TypeError, "fragments must be an int \\(how many\\) or a list of lists"),
        ({"fragments": 2.0}, TypeError, "got float 2.0"),
        ({"fragments": [names[:2], names[1:]]}, ValueError, "'0.bias' is in fragments 0 and 1"),
        ({"fragments": names}, TypeError, "fragments\\[0\\] is str '0.weight', not a list of parameter names"),
        ({"fragments": [names[:2], ["nope"]]}, ValueError, "names 'nope', which is not a parameter"),
        ({"fragments": [names[:3]]}, ValueError, r"1 parameters are in no fragment \(first: \['2.bias'\]\)"),
        ({"fragments": 2, "sync_every": 8, "fragment_sync_delay": 4}, ValueError,
         "fragment_sync_delay \\(τ\\) = 4 must be an int with 0 <= τ < sync_every / fragments = 4"),
        ({"fragment_sync_delay": -1}, ValueError, "fragment_sync_delay \\(τ\\) = -1"),
        ({"fragment_update_alpha": 1.5}, ValueError, r"fragment_update_alpha \(α\) = 1.5 must be a number in \[0, 1\]"),
        ({"fragment_update_alpha": "0.5"}, ValueError, r"fragment_update_alpha \(α\) = '0.5' must be a number"),
        ({"fragment_update_alpha": float("nan")}, ValueError, r"fragment_update_alpha \(α\) = nan"),
        ({"fragments": 2, "average_moments": True}, ValueError, "average_moments=True is not supported"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_bad_arguments_are_refused_naming_them(case):
    kwargs, error, match = _bad()[case]
    model = make_model()
    with pytest.raises(error, match=match):
        hvd.DiLoCo(model.named_parameters(), **{"sync_every": 4, **kwargs})


def test_numpy_schedule_with_the_built_in_outer_step():
    w = {"a": np.arange(4.0), "b": np.ones(2)}
    sched = StreamingSync(list(w.items()), LocalSyncConfig(sync_every=2, outer_lr=0.5), fragments=2)
    assert sched.fragments == [["a"], ["b"]]  # "a" holds 4 of the 6 elements: past half, so a cut after it
    w["a"] -= 1.0
    w["b"] -= 3.0
    assert sched.tick()
    landed = sched.sync()  # fragment 0 lands after step 1: Δ = 1, θ_ref = a0 - 0.5·1
    assert set(landed) == {"a"}
    np.testing.assert_allclose(landed["a"], 1.0)
    np.testing.assert_allclose(w["a"], np.arange(4.0) - 0.5)
    np.testing.assert_allclose(w["b"], -2.0)  # fragment 1 keeps training
    assert sched.tick()
    landed = sched.sync()  # fragment 1 after step 2: Δ = 3, θ_ref = 1 - 1.5
    assert set(landed) == {"b"}
    np.testing.assert_allclose(w["b"], -0.5)
    assert sched.syncs == 2 and sched.steps == 2


def test_schedule_keeps_the_contract():
    from commwire.schedules import Schedule

    sched = StreamingSync([("a", np.zeros(3))], LocalSyncConfig(sync_every=4), delay=2)
    assert isinstance(sched, Schedule) and sched.fragments == [["a"]]
    assert [s for s in range(1, 9) if sched.due(s)] == [2, 4, 6, 8]  # begins 2 steps before it lands


def test_wall_clock_bench_runs_and_reports_the_exposed_sync():
    from research import load

    bench = load("streaming_diloco")
    rows = [{"arm": arm, "repeat": r, "s_per_step": base + 0.01 * r, "max_step_s": 2 * base,
             "largest_sync_bytes": 2.0 ** 20, "bytes_per_step": 1e3}
            for r in range(3) for arm, base in (("local", 0.1), ("diloco", 0.15))]
    table = bench.summarize(rows)
    assert "| diloco | 160.0 (150.0–170.0) | 50.0 | 300 (300–300) | 1.00 MiB | 1.0 kB |" in table
    bench.main(["--quick", "--arms", "local,streaming"])  # one process: the lane still moves the fragments


def test_a_rebind_drops_the_sync_in_flight_and_the_next_one_carries_it():
    model = make_model()
    opt = hvd.DiLoCo(model.named_parameters(), sync_every=4, fragments=2, fragment_sync_delay=1,
                     inner_optimizer=torch.optim.SGD(model.parameters(), lr=0.05), outer_lr=1.0, outer_momentum=0.0)
    train(model, opt, range(5))  # fragment 0 began after step 5, to land after 6
    first = opt.fragments[0]
    before = {n: opt._sync.reference[n].clone() for n in first}
    opt._rebind()  # what commwire.elastic does once the world has re-formed
    assert not any(part.in_flight for part in opt._sync.parts)
    train(model, opt, range(5, 6))
    assert opt._sync.dropped == 1
    for n in first:
        assert torch.equal(opt._sync.reference[n], before[n])  # nothing landed: θ_ref is unchanged
    train(model, opt, range(6, 9))  # fragment 0 begins after step 9 with both periods' progress
    params = dict(model.named_parameters())
    at_nine = {n: params[n].detach().clone() for n in first}
    train(model, opt, range(9, 10))  # and lands after 10
    for n in first:  # plain averaging on one rank, α = 0: θ_ref and θ are the local weights of step 9
        assert not torch.equal(at_nine[n], before[n])
        torch.testing.assert_close(opt._sync.reference[n], at_nine[n], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(params[n].detach(), at_nine[n], rtol=1e-6, atol=1e-7)


def test_the_user_guide_example_runs():
    from docs_examples import python_block

    model = make_model()
    namespace = {"hvd": hvd, "model": model}
    exec(python_block("usage.md", "fragment_update_alpha=0.5"), namespace)  # noqa: S102
    opt = namespace["opt"]
    assert len(opt.fragments) == 4 and opt._sync.delay == 1 and opt._sync.alpha == 0.5
    train(model, opt, range(16))
    assert opt._sync.syncs == 4 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_rebind_keeps_a_factory_built_outer_optimizer_stepping(fragments):
    def build():
        model = make_model()
        return model, hvd.DiLoCo(model.named_parameters(), lr=1e-2, sync_every=4, fragments=fragments,
                                 outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))

    (model, opt), (twin, twin_opt) = build(), build()
    train(model, opt, range(5))
    train(twin, twin_opt, range(5))
    opt._rebind()  # a healthy world, nothing in flight (no delay): training must go on exactly as without it
    train(model, opt, range(5, 13))
    train(twin, twin_opt, range(5, 13))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert all(torch.equal(a, b) for a, b in zip(opt._sync.reference.values(), twin_opt._sync.reference.values()))


def test_checkpoints_refuse_another_shape_and_keep_one_codec_state():
    def build(**kw):
        model = make_model()
        return model, hvd.DiLoCo(model.named_parameters(), lr=1e-2, sync_every=4, codec="ef+fp8-e4m3", **kw)

    model, opt = build(fragments=2, fragment_sync_delay=1)
    train(model, opt, range(5))
    saved = opt.state_dict()
    codec_states = [part["codec"]["codec"] for part in saved["commwire"]["schedule"]["parts"]]
    assert codec_states[0] is not None and codec_states[1:] == [None]  # the fragments share one codec
    for kw, match in (({}, "saved by DiLoCo with fragments"), ({"fragments": 2}, "fragment_sync_delay=1")):
        other_model, other = build(**kw)
        before = [p.clone() for p in other_model.parameters()]
        with pytest.raises(ValueError, match=match):
            other.load_state_dict(saved)
        assert all(torch.equal(a, b) for a, b in zip(before, other_model.parameters()))
    plain_model, plain = build()
    train(plain_model, plain, range(2))
    _, streaming = build(fragments=2)
    with pytest.raises(ValueError, match="saved by DiLoCo without fragments"):
        streaming.load_state_dict(plain.state_dict())


@pytest.mark.mpi
def test_streaming_on_two_ranks_over_torchs_gloo():
    from mpi_helpers import run_mpi_pytest

    # mpi_lordo.py's streaming tests (2 ranks over MPI run with the rest of that file): the lane over gloo
    run_mpi_pytest(2, "tests/lordo/mpi_lordo.py", transport="torch", only="streaming", timeout=300)
