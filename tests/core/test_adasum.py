"""Adasum all-reduce on 1, 2, 4 and 8 ranks — tier 2 (launches mpiexec; see mpi_adasum.py)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_adasum_suite(n):
    run_mpi_pytest(n, "tests/core/mpi_adasum.py")
