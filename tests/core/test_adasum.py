"""Adasum all-reduce on 1, 2 and 4 ranks — tier 2 (launches mpiexec; see mpi_adasum.py)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


# 4 ranks take the recursion through two levels, which is every path 8 ranks take (8 processes on
# 2 cores cost ~20 s of a CI run); a group of 3 is refused (tested at 4 ranks).
@pytest.mark.parametrize("n", [1, 2, 4])
def test_adasum_suite(n):
    run_mpi_pytest(n, "tests/core/mpi_adasum.py")
