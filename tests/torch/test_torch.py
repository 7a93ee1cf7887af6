"""PyTorch adapter on 2 and 3 ranks — tier 2 (launches mpiexec); GPU paths in tests/gpu."""

import pytest
from mpi_helpers import run_mpi_pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi


# 3 ranks: several peers and a size that is not a power of two; 4 ranks took 68 s of a CI run
# (4 processes on 2 cores) and reach no path 3 does not.
@pytest.mark.parametrize("n,transport", [(2, "mpi"), (3, "mpi"), (2, "torch")])
def test_torch_suite(n, transport):
    run_mpi_pytest(n, "tests/torch/mpi_torch.py", timeout=600, transport=transport)
