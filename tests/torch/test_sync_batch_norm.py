"""SyncBatchNorm on 1, 2 and 4 ranks — tier 2 (launches mpiexec; see mpi_sync_batch_norm.py)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 4])
def test_sync_batch_norm_suite(n):
    run_mpi_pytest(n, "tests/torch/mpi_sync_batch_norm.py")
