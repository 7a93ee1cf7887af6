"""GLM solvers over the 1D block-column layout: SGD and mixed-precision CA-SGD.

``GLM`` (the scikit-learn style estimator) is loaded on first access, so the
solvers work without scikit-learn installed.
"""

from __future__ import annotations

from typing import Any

from ._auto import AutoS
from .data import ColumnBlocks, column_ranges, from_array, load_npy, load_svmlight
from .precision import PRESETS, Precision, get_precision
from .solver import FitResult, SolverConfig, batch_indices, margins, objective, solve

__all__ = [
    "GLM",
    "AutoS",
    "PRESETS",
    "ColumnBlocks",
    "FitResult",
    "Precision",
    "SolverConfig",
    "batch_indices",
    "column_ranges",
    "from_array",
    "get_precision",
    "load_npy",
    "load_svmlight",
    "margins",
    "objective",
    "solve",
]


def __getattr__(name: str) -> Any:
    if name == "GLM":
        try:
            from ._estimator import GLM
        except ImportError as exc:  # optional dependency: fail at first use with the hint
            raise ImportError("commwire.glm.GLM needs scikit-learn: pip install scikit-learn") from exc
        return GLM
    raise AttributeError(f"module 'commwire.glm' has no attribute {name!r}")
