"""Compressed all-reduce, reduce-scatter and all-gather on several ranks — tier 2 (launches mpiexec)."""

import pytest
from mpi_helpers import BOTH_TRANSPORTS, run_mpi_pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n,transport", BOTH_TRANSPORTS)
def test_compressed_allreduce_suite(n, transport):
    run_mpi_pytest(n, "tests/collectives/mpi_compressed.py", transport=transport)


@pytest.mark.parametrize("n,transport", BOTH_TRANSPORTS)
def test_compressed_reduce_scatter_and_allgather_suite(n, transport):
    run_mpi_pytest(n, "tests/collectives/mpi_sharded.py", transport=transport)
