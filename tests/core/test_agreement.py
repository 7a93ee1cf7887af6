"""Errors agree across ranks, join() and the new dtypes/ops — tier 2 (launches mpiexec -n 2 and -n 4)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n,transport", [(2, "mpi"), (4, "mpi"), (2, "torch")])
def test_agreement_suite(n, transport):
    run_mpi_pytest(n, "tests/core/mpi_agreement.py", transport=transport)
