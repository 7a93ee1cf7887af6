"""commwire's collectives under FSDP2 against FSDP2's own — tier 2 (launches mpiexec -n 2 and -n 4)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


# 2 ranks run every FSDP2 test; 4 ranks (4 processes on 2 cores: ~55 s for all) only the HSDP
# ones, which need 2 replicas x 2 shards.
@pytest.mark.parametrize("n,only", [(2, None), (4, "hsdp")])
def test_fsdp_suite(n, only):
    pytest.importorskip("torch.distributed.fsdp")
    run_mpi_pytest(n, "tests/torch/mpi_fsdp.py", "-W", "ignore::UserWarning", "-W", "ignore::FutureWarning",
                   timeout=600, only=only)


def test_bench_combines_seeds_against_the_first_configuration():
    from commwire.bench.ddp import over_seeds
    from commwire.bench.fsdp import _parse, format_table

    def row(config, step_ms, loss, rs_mb, ag_mb):
        return {"config": config, "ranks": 4, "params": 3e6, "step_ms": step_ms, "ratio_vs_fsdp": step_ms / 600.0,
                "MB_per_step": rs_mb + ag_mb, "rs_MB": rs_mb, "ag_MB": ag_mb, "ar_MB": 0.0,
                "rs_vs_first": rs_mb / 9.0, "bytes_vs_fp32": (rs_mb + ag_mb) / 15.0, "val_loss": loss}

    runs = [[row("fsdp", 600.0, 3.20, 9.0, 6.0), row("commwire rs=fp8-e4m3 ag=fp8-e4m3", 400.0, 3.21, 2.25, 1.5)],
            [row("fsdp", 660.0, 3.24, 9.0, 6.0), row("commwire rs=fp8-e4m3 ag=fp8-e4m3", 420.0, 3.30, 2.25, 1.5)],
            [row("fsdp", 630.0, 3.22, 9.0, 6.0), row("commwire rs=fp8-e4m3 ag=fp8-e4m3", 380.0, 3.24, 2.25, 1.5)]]
    runs[0][1]["val_curve"], runs[1][1]["val_curve"], runs[2][1]["val_curve"] = [3.5, 3.21], [3.4, 3.30], [3.6, 3.24]
    fsdp_row, fp8 = over_seeds(runs, reference="fsdp", key="fsdp")
    assert fp8["val_curves"] == [[3.5, 3.21], [3.4, 3.30], [3.6, 3.24]] and "val_curve" not in fp8
    assert "val_curves" not in fsdp_row
    assert fsdp_row["step_ms"] == 630.0 and fsdp_row["val_loss_range"] == (3.20, 3.24)
    assert fp8["rs_vs_first"] == 0.25 and abs(fp8["bytes_vs_fp32"] - 0.25) < 1e-12
    assert fp8["within_fsdp_range"] is False  # mean 3.25 > FSDP's worst seed 3.24
    table = format_table([fsdp_row, fp8])
    assert "| commwire rs=fp8-e4m3 ag=fp8-e4m3 | 400.0 | 0.67× | 3.75 (2.25 + 1.50) | 0.250 | 0.250 |" in table
    assert _parse("hsdp replicate=ef+nvfp4") == {"hsdp": True, "bf16": False, "rs": None, "ag": None,
                                                 "replicate": "ef+nvfp4"}
    assert _parse("commwire bf16 rs=ef+fp8-e4m3 ag=fp8-e4m3")["bf16"] is True
    assert _parse("commwire rs=ef+hadamard+nvfp4")["rs"] == "ef+hadamard+nvfp4"
    for bad, why in (("commwire ag=ef+fp8-e4m3", "error feedback"), ("dp", "expected 'fsdp"),
                     ("fsdp rs=fp8-e4m3", "expected"), ("commwire", "names no codec"),
                     ("commwire rs=fp9", "unknown codec 'fp9'")):
        with pytest.raises(ValueError, match=why):
            _parse(bad)
