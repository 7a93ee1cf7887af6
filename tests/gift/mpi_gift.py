"""GIFT on several ranks — tier 2 (run under mpiexec by test_mpi.py).

Checks: factors bit-identical on every rank after a refresh from different
per-rank statistics (and equal to the factor of the averaged statistics);
ranks holding different transforms are refused on every rank; a compressed
all-reduce of a fused bucket through GIFT matches the float64 sum within the
inner codec's bound; DistributedOptimizer with GIFT keeps the ranks' models identical.
"""

from __future__ import annotations

import numpy as np
import pytest

import commwire as cw
from commwire import codecs
from commwire.codecs.collective import compressed_allreduce
from commwire.codecs.gift import factor_from_gram

torch = pytest.importorskip("torch")
COMM = cw.init()
RANK, SIZE = COMM.rank, COMM.size


def _gram(rank: int, d: int = 24) -> np.ndarray:
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((300, d)) * np.geomspace(10.0, 0.1, d)
    return x.T @ x


def _refreshed(spec: str = "gift:rank=6+fp8-e4m3") -> codecs.Codec:
    codec = codecs.get(spec)
    for i, name in enumerate(("l0.weight", "l1.weight", "l2.weight")):
        codec.observe(name, _gram(RANK + 10 * i), 300)
    codec.refresh(COMM)
    return codec


def test_factors_are_identical_on_every_rank_and_use_the_averaged_statistics():
    codec = _refreshed()
    mine = {n: (f.u.tobytes(), f.lam.tobytes(), f.sigma) for n, f in codec.factors().items()}
    everyone = COMM.allgather_object(mine)
    assert all(other == everyone[0] for other in everyone)
    mean = sum(_gram(r + 10) for r in range(SIZE)) / (300 * SIZE)
    expect = factor_from_gram(mean, rank=6, damping=1e-3).matrix()
    got = codec.factors()["l1.weight"].matrix()
    assert np.linalg.norm(got - expect) / np.linalg.norm(expect) < 1e-10


def test_ranks_holding_different_transforms_are_refused_everywhere():
    codec = _refreshed()
    state = codec.state_dict()
    if RANK == SIZE - 1:
        slot = state["stages"][0][("gift", "factor", "l0.weight")]
        slot["lam"] = slot["lam"] * 1.01
    codec.load_state_dict(state)
    with pytest.raises(RuntimeError, match="not verified"):
        codec.tensor_forward(np.zeros(5 * 24, np.float32), "l0.weight")
    with pytest.raises(RuntimeError, match=rf"ranks \[{SIZE - 1}\] hold factors other than rank 0's"):
        codec.verify(COMM)
    with pytest.raises(RuntimeError, match="not verified"):
        codec.tensor_forward(np.zeros(5 * 24, np.float32), "l0.weight")


def test_refresh_refuses_ranks_that_observed_different_layers():
    codec = codecs.get("gift:rank=6+fp8-e4m3")
    codec.observe("a.weight" if RANK else "b.weight", _gram(RANK), 300)
    with pytest.raises(RuntimeError, match="observed different layers"):
        codec.refresh(COMM)


@pytest.mark.parametrize("spec,bound", [("gift:rank=6+fp16", 3e-3), ("gift:rank=6+fp8-e4m3", 0.06),
                                        ("gift:rank=6+nvfp4", 0.2)])
@pytest.mark.parametrize("small", [True, False])
def test_compressed_allreduce_of_a_fused_bucket(spec, bound, small):
    codec = _refreshed(spec)
    layout = [("l0.bias", 0, (24,)), ("l0.weight", 24, (40, 24)), ("l1.weight", 984, (40, 24)),
              ("l2.weight", 1944, (200, 24))]
    codec.bind_layout("bucket", layout)
    n = 1944 + 200 * 24
    # Gradient-like data: weight rows share the input statistics' geometry (column scales).
    columns = np.tile(np.geomspace(10.0, 0.1, 24), n // 24)
    parts = [(np.random.default_rng(7 + r).standard_normal(n) * columns).astype(np.float32) for r in range(SIZE)]
    expect = np.sum([p.astype(np.float64) for p in parts], axis=0)
    out = compressed_allreduce(COMM, parts[RANK], "sum", codec=codec, name="bucket",
                               small_bytes=1 << 30 if small else 0)
    assert np.linalg.norm(out - expect) / np.linalg.norm(expect) < bound
    digests = COMM.allgather_object(out.tobytes())
    assert all(d == digests[0] for d in digests)


def test_distributed_optimizer_with_gift_keeps_ranks_identical():
    import commwire.torch as hvd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    codec = codecs.get("gift:rank=8,refresh=3+fp8-e4m3")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=codec, model=model,
                                   fusion_threshold_mb=0.001)
    g = torch.Generator().manual_seed(RANK)
    for _ in range(8):
        x = torch.randn(32, 16, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
        opt.step()
    assert codec.version >= 2 and set(codec.factors()) == {"0.weight", "2.weight"}
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
    everyone = COMM.allgather_object(flat)
    assert all(f == everyone[0] for f in everyone)
    opt.load_state_dict(opt.state_dict())  # verifies the factors across ranks


@pytest.mark.parametrize("spec", ["fp8-e4m3", "ef+nvfp4", "gift:rank=6+fp8-e4m3", "gift:rank=6+nvfp4"])
@pytest.mark.parametrize("small", [True, False])
def test_simulated_allreduce_is_bit_identical_to_the_real_collective(spec, small):
    """The GIFT benchmark's one-process simulation (benchmarks/_simulated.py) against the real collective."""
    from research import load

    SimulatedAllreduce = load("_simulated").SimulatedAllreduce
    from commwire.codecs.collective import segment_bytes_for

    real = _refreshed(spec) if spec.startswith("gift") else codecs.get(spec)
    sim = codecs.get(spec)
    if spec.startswith("gift"):
        sim.load_state_dict(real.state_dict())  # the same factors (identical on every rank after the refresh)
        sim.verify(COMM)
    layout = [("l0.bias", 0, (24,)), ("l0.weight", 24, (40, 24)), ("l1.weight", 984, (40, 24)),
              ("l2.weight", 1944, (12000, 24))]
    n = 1944 + 12000 * 24  # several pipeline segments, the first one smaller
    real.bind_layout("bucket", layout)
    small_bytes = 1 << 30 if small else 0
    reduce = SimulatedAllreduce(sim, SIZE, peer_bytes=32 << 10, small_bytes=small_bytes)
    reduce.bind_layout("bucket", layout)
    columns = np.tile(np.geomspace(10.0, 0.1, 24), n // 24)
    for call in range(3):  # later calls exercise error-feedback residuals
        parts = [(np.random.default_rng(50 * call + r).standard_normal(n) * columns).astype(np.float32)
                 for r in range(SIZE)]
        got = compressed_allreduce(COMM, parts[RANK], "avg", codec=real, name="bucket", small_bytes=small_bytes,
                                   segment_bytes=segment_bytes_for(real, SIZE, 32 << 10))
        want = reduce("bucket", parts)
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        assert got.tobytes() == want.tobytes(), f"call {call}: max |diff| {np.abs(got - want).max()}"
