"""PyTorch adapter, 3 ranks over MPI and 2 over the torch transport — tier 2 (mpiexec); GPU paths in tests/gpu."""

import pytest
from mpi_helpers import run_mpi_pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi


# MPI at 3 ranks (several peers, a size that is not a power of two), the torch transport at 2: a
# third job at 2 or 4 ranks reaches no path of its own (4 processes on 2 cores took 68 s of a CI run).
@pytest.mark.parametrize("n,transport", [(3, "mpi"), (2, "torch")])
def test_torch_suite(n, transport):
    run_mpi_pytest(n, "tests/torch/mpi_torch.py", timeout=600, transport=transport)


def test_training_bench_rows_count_every_gradient_byte(tmp_path):
    # The DistributedOptimizer-vs-DDP benchmark on 2 ranks and a tiny MLP: every FP32 arm sends
    # each gradient's 4 bytes once a step (fused: one all-reduce; unfused: one per tensor); the arm
    # without overlap hides nothing.
    import json

    from mpi_helpers import run_mpi

    out = tmp_path / "rows.json"
    proc = run_mpi(2, ["-m", "commwire.bench.torch_ddp", "--layers", "3", "--width", "16", "--steps", "2",
                       "--rounds", "1", "--codecs", "", "--no-overlap", "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["ddp-gloo fp32", "commwire fp32", "commwire fp32 unfused", "commwire fp32 no overlap"]
    params = 3 * (16 * 16 + 16)
    for name, row in rows.items():
        assert row["wire_MB_per_step"] == pytest.approx(params * 4 / 1e6), name
        assert row["step_ms"] > 0 and row["ranks"] == 2 and row["tensors"] == 6
    assert rows["ddp-gloo fp32"]["ratio_vs_ddp"] == 1.0
    assert rows["commwire fp32"]["collectives_per_step"] == 1
    assert rows["commwire fp32 unfused"]["collectives_per_step"] == 6
    assert rows["commwire fp32 no overlap"]["hidden_fraction"] == 0.0
