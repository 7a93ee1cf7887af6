"""Shared setup of the GLM tests: import paths and one BLAS thread per process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent):  # _reference (here) and mpi_helpers (tests/)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(autouse=True, scope="session")
def _one_blas_thread():
    # Several ranks share two cores here: threaded BLAS on small GEMMs runs 20-40x slower.
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield
