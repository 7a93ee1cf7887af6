"""GLM solvers on cupy arrays — tier 3 (GPU): tests/glm/test_gpu.py, run here so that it never skips on a GPU.

tests/glm/test_gpu.py (owned with the GLM code) checks that the array-module
path on the device matches the numpy path: FP64 to 1e-10 relative, mixed
precision to 1e-4. Collected anywhere, it skips without cupy or a device; this
test runs it in a fresh single-rank process on a GPU machine and fails if any
of its tests fails or skips (a missing cupy included).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _gpu import require_cupy

ROOT = Path(__file__).resolve().parents[2]


def test_glm_gpu_suite_runs_and_skips_nothing():
    require_cupy()
    # A fresh process that initialises MPI alone: drop the launcher's variables (this rank's own).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=",
                           "tests/glm/test_gpu.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, proc.stdout[-4000:]
