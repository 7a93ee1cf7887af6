"""commwire's DDP communication hook against plain DDP — tier 2 (launches mpiexec -n 2 and -n 4)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


# 2 ranks run every hook test; 4 ranks (4 processes on 2 cores) only the ones on two DDP
# subgroups of 2 and on two groups of 2 (hierarchical), which need them.
@pytest.mark.parametrize("n,only", [(2, None), (4, "subgroup or hierarchical")])
def test_ddp_hook_suite(n, only):
    run_mpi_pytest(n, "tests/torch/mpi_ddp.py", timeout=600, only=only)


def test_bench_combines_seeds_and_checks_each_hook_against_ddps_range():
    from commwire.bench.ddp import format_table, over_seeds

    def row(config, step_ms, loss):
        return {"config": config, "ranks": 4, "params": 1e6, "step_ms": step_ms, "ratio_vs_ddp": step_ms / 100.0,
                "MB_per_step": 4.0, "bytes_vs_fp32": 1.0, "val_loss": loss}

    runs = [[row("ddp", 100.0, 3.0), row("commwire ef+fp8-e4m3", 40.0, 3.05)],
            [row("ddp", 110.0, 3.2), row("commwire ef+fp8-e4m3", 50.0, 3.25)],
            [row("ddp", 120.0, 3.1), row("commwire ef+fp8-e4m3", 60.0, 3.5)]]
    ddp, fp8 = over_seeds(runs)
    assert ddp["step_ms"] == 110.0 and ddp["val_loss_range"] == (3.0, 3.2) and ddp["seeds"] == 3
    assert abs(ddp["val_loss"] - 3.1) < 1e-12 and abs(ddp["val_loss_sd"] - 0.1) < 1e-12
    assert abs(fp8["val_loss"] - 3.2666666666666666) < 1e-12 and fp8["within_ddp_range"] is False  # > 3.2
    assert ddp["within_ddp_range"] is True
    table = format_table([ddp, fp8])
    assert "3 seeds" in table and "| no |" in table and "3.0000–3.2000" in table


def test_bench_runs_every_kind_of_row_and_measures_its_bytes(tmp_path):
    # A tiny model through the real benchmark on 2 ranks (20 kB buckets: several per step, each its
    # own residual key): commwire's uncompressed hook trains
    # exactly like DDP's built-in all-reduce and sends its FP32 bytes; FP8 sends about a quarter
    # (its block scales on top); the no-communication floor sends nothing. Every row runs torch's
    # fused AdamW (--optimizer), so the DDP rows stay equal under it too.
    import json

    from mpi_helpers import run_mpi

    out = tmp_path / "rows.json"
    proc = run_mpi(2, ["-m", "commwire.bench.ddp", "--d-model", "32", "--layers", "1", "--batch", "2",
                       "--context", "8", "--steps", "2", "--rounds", "1", "--json", str(out), "--bucket-mb", "0.02",
                       "--optimizer", "adamw-fused",
                       "--configs", "ddp,commwire none,commwire fp8-e4m3,ddp powersgd r1,no communication"],
                   timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    fp32 = rows["ddp"]["MB_per_step"]
    assert fp32 == pytest.approx(rows["ddp"]["params"] * 4 / 1e6)
    assert rows["commwire none"]["MB_per_step"] == pytest.approx(fp32)
    assert rows["commwire none"]["val_loss"] == pytest.approx(rows["ddp"]["val_loss"], rel=1e-5)
    assert 0.25 <= rows["commwire fp8-e4m3"]["bytes_vs_fp32"] < 0.3
    assert rows["no communication"]["MB_per_step"] == 0
    # DDP's PowerSGD over many buckets (its buckets chained: unchained they can hang, see
    # commwire.bench.ddp._ordered_powersgd) compresses the matrices at rank 1.
    assert rows["ddp powersgd r1"]["bytes_vs_fp32"] < 0.5
    assert all(r["step_ms"] > 0 and 0 < r["val_loss"] < 10 for r in rows.values())
    assert {r["optimizer"] for r in rows.values()} == {"adamw-fused"}


def test_bench_refuses_a_bucket_size_that_is_not_positive_and_an_unknown_optimizer():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "commwire.bench.ddp", "--bucket-mb", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--bucket-mb 0" in done.stderr and "> 0" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "commwire.bench.ddp", "--optimizer", "sgd"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "'sgd'" in done.stderr and "adamw-fused" in done.stderr, done.stderr
