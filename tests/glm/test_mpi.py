"""Run tests/glm/mpi_glm.py on 1, 2 and 4 ranks and mpi_auto.py on 2 and 4 — tier 2 (mpiexec, CPU).

Tiers of the GLM suite: test_precision/test_sstep/test_solver/test_estimator run
in one process; this module launches mpi_glm.py under mpiexec; test_gpu.py needs
CuPy and a GPU and skips cleanly without them.
"""

from __future__ import annotations

import pytest

from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_glm_on_ranks(ranks: int) -> None:
    run_mpi_pytest(ranks, "tests/glm/mpi_glm.py", timeout=240)


@pytest.mark.parametrize("ranks", [2, 4])
def test_auto_s_on_ranks(ranks: int) -> None:
    run_mpi_pytest(ranks, "tests/glm/mpi_auto.py", timeout=240)
