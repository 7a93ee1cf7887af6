"""Fuzzing of checkpoint files on 2 ranks — tier 2 (launches mpiexec).

50 variants by default (about half a minute); the full campaign:

    COMMWIRE_CKPT_FUZZ_VARIANTS=1000 python -m pytest tests/reliability/test_checkpoint_fuzz.py -s
"""

import json
import os

import pytest
from mpi_helpers import run_mpi

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi

VARIANTS = int(os.environ.get("COMMWIRE_CKPT_FUZZ_VARIANTS", "50"))


def test_every_damaged_or_foreign_checkpoint_is_refused_on_every_rank(tmp_path):
    proc = run_mpi(2, ["tests/reliability/mpi_checkpoint_fuzz.py", "--variants", str(VARIANTS), "--seed", "1",
                       "--workdir", str(tmp_path)], timeout=120 + VARIANTS)  # a hang trips the job's watchdog
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FUZZ-SUMMARY ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    summary = json.loads(lines[-1].split(" ", 1)[1])
    print(f"\ncheckpoint fuzz: {json.dumps({k: v for k, v in summary.items() if k != 'per_kind'})}")
    assert summary["failures"] == []
    assert summary["refused_on_every_rank"] == VARIANTS
    assert summary["code_ran"] is False
    assert summary["controls_loaded"] is True
    assert summary["save_refused_on_every_rank"] is True
    assert not (tmp_path / "CODE-RAN").exists()
