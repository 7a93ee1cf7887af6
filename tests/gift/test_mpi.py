"""GIFT on 2 ranks — tier 2 (launches mpiexec on tests/gift/mpi_gift.py)."""

import pytest
from mpi_helpers import run_mpi_pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi


def test_gift_suite_on_two_ranks():
    run_mpi_pytest(2, "tests/gift/mpi_gift.py", timeout=300)
