"""commwire's DDP communication hook against plain DDP — tier 2 (launches mpiexec -n 2 and -n 4)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_hook_suite(n):
    run_mpi_pytest(n, "tests/torch/mpi_ddp.py", timeout=600)
