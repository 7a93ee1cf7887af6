"""The torch transport (torch.distributed over gloo) against the MPI transport — tier 2 (2 and 3 ranks)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi
pytest.importorskip("torch")


@pytest.mark.parametrize("n", [2, 3])
def test_torch_transport_suite(n):
    run_mpi_pytest(n, "tests/core/mpi_transport.py")
