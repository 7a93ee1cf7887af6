"""The horovod.torch API of commwire.torch on 1, 2 and 4 ranks — tier 2 (launches mpiexec)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n,transport", [(1, "mpi"), (2, "mpi"), (4, "mpi"), (2, "torch")])
def test_horovod_api_suite(n, transport):
    run_mpi_pytest(n, "tests/torch/mpi_horovod.py", timeout=600, transport=transport)
