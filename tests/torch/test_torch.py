"""PyTorch adapter on 2 and 4 ranks — tier 2 (launches mpiexec); GPU paths in tests/gpu."""

import pytest
from mpi_helpers import run_mpi_pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n,transport", [(2, "mpi"), (4, "mpi"), (2, "torch")])
def test_torch_suite(n, transport):
    run_mpi_pytest(n, "tests/torch/mpi_torch.py", timeout=600, transport=transport)
