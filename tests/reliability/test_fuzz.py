"""Fuzzing of collectives and codecs on 3 ranks — tier 2 (launches mpiexec)."""

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


def test_fuzz_suite_on_three_ranks():
    run_mpi_pytest(3, "tests/reliability/mpi_fuzz.py", timeout=600)
