"""SyncBatchNorm on 1 and 3 ranks — tier 2 (launches mpiexec; see mpi_sync_batch_norm.py)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi


# 1 rank (the one-rank shortcut) and 3 (several peers, uneven batches, not a power of two)
@pytest.mark.parametrize("n", [1, 3])
def test_sync_batch_norm_suite(n):
    run_mpi_pytest(n, "tests/torch/mpi_sync_batch_norm.py")
