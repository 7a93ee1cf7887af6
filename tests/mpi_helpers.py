"""Launch MPI jobs from tests (tier 2 helpers); imported as `mpi_helpers`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def mpiexec_path() -> str | None:
    local = Path(sys.prefix) / "bin" / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def run_mpi(n: int, args: list[str], timeout: float = 240, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``n`` ranks and return the completed process (never hangs)."""
    exe = mpiexec_path()
    if exe is None:
        pytest.skip("no mpiexec: pip install 'commwire[mpich]'")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "COMMWIRE_RUN": "1", **(env or {})}
    cmd = [exe, "-n", str(n), sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def run_mpi_pytest(n: int, path: str, *extra: str, timeout: float = 300, transport: str = "mpi",
                   only: str | None = None) -> None:
    """Run a pytest module on ``n`` ranks with the world's data on ``transport`` (COMMWIRE_TRANSPORT);
    ``only``: just the tests whose names match this ``-k`` expression.

    Fails with every rank's output if any rank fails.
    """
    if transport == "torch":
        pytest.importorskip("torch")
    select = ("-k", only) if only else ()
    proc = run_mpi(n, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                       "-o", "addopts=", path, *extra, *select], timeout=timeout, env={"COMMWIRE_TRANSPORT": transport})
    if proc.returncode != 0:
        pytest.fail(f"{path} failed on {n} ranks over {transport} (exit {proc.returncode}):\n{proc.stdout[-8000:]}\n"
                    f"{proc.stderr[-4000:]}")


BOTH_TRANSPORTS = [(2, "mpi"), (4, "mpi"), (3, "torch")]
"""(ranks, transport) of the suites that run on both transports: MPI at 2 and 4 ranks, torch.distributed (gloo)
at 3 (uneven blocks, a rank count that is not a power of two), so the suite stays inside its time budget."""


TOL = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-5, "float64": 1e-12}
"""Tolerance of each float dtype against a float64 reference (one rounding of the sum; 0 = exact)."""


def check_close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    """Compare a result with its float64 (or exact) reference at the dtype's tolerance."""
    assert got.shape == want.shape, (got.shape, want.shape)
    if dtype in TOL:
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype])
    else:
        np.testing.assert_array_equal(got, want.astype(got.dtype))
