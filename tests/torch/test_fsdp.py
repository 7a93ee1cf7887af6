"""commwire's collectives under FSDP2 against FSDP2's own — tier 2 (launches mpiexec -n 2 and -n 4)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp_suite(n):
    pytest.importorskip("torch.distributed.fsdp")
    run_mpi_pytest(n, "tests/torch/mpi_fsdp.py", "-W", "ignore::UserWarning", "-W", "ignore::FutureWarning",
                   timeout=600)
