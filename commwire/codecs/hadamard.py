"""Random Hadamard rotation: spread outliers across a block before quantising.

Each run of ``size`` consecutive elements (a power of two, 16 by default as in
NVIDIA's NVFP4 recipe) is multiplied by ``D H / sqrt(size)``: ``H`` the Sylvester
Hadamard matrix, ``D`` a diagonal of random signs drawn once from ``seed``. All
ranks use the same seed, hence the same signs, so their rotated values can be
summed. The matrix is orthonormal: the inverse is its transpose. A tail of fewer
than ``size`` elements is left as is, so the length never changes.
Non-finite values spread to their whole block (every element there decodes NaN).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import numpy as np

from ..comm import arrays
from .pipeline import Transform

__all__ = ["HadamardConfig", "HadamardTransform"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HadamardConfig:
    """Settings of the random Hadamard rotation."""

    size: int = 16
    """Block length, a power of two between 2 and 4096."""
    seed: int = 0
    """Seed of the shared random signs (must be equal on all ranks)."""

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 2 or self.size > 4096 or self.size & (self.size - 1):
            raise ValueError(f"HadamardConfig.size={self.size!r}; use a power of two between 2 and 4096")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"HadamardConfig.seed={self.seed!r}; use a non-negative int")


def _sylvester(size: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h


class HadamardTransform(Transform):
    """Rotate blocks of ``size`` elements by a fixed random-signed Hadamard matrix."""

    device_capable = True  # a matrix product on the tensor's device

    def __init__(self, config: HadamardConfig | None = None, **settings: Any) -> None:
        super().__init__()
        self.config = config if config is not None else HadamardConfig(**settings)
        size = self.config.size
        signs = np.random.default_rng(self.config.seed).choice([-1.0, 1.0], size=size)
        self.matrix = (signs[:, None] * _sylvester(size) / np.sqrt(size)).astype(np.float32)
        self._device_matrices: dict[str, Any] = {}

    @property
    def spec(self) -> str:
        """Return ``"hadamard"`` or ``"hadamard:size=N,seed=S"`` (defaults omitted)."""
        c = self.config
        options = ([f"size={c.size}"] if c.size != 16 else []) + ([f"seed={c.seed}"] if c.seed else [])
        return "hadamard" + (":" + ",".join(options) if options else "")

    def _matrix_like(self, x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return self.matrix
        device = str(x.device)
        if device not in self._device_matrices:
            import torch

            self._device_matrices[device] = torch.as_tensor(self.matrix, device=x.device)
        return self._device_matrices[device]

    def _apply(self, x: Any, out: Any, transpose: bool) -> Any:
        size = self.config.size
        m = int(x.shape[0]) // size * size
        matrix = self._matrix_like(x)
        matrix = matrix.T if transpose else matrix
        if isinstance(x, np.ndarray):
            # NaN/Inf spread through the block by design (see the module docstring): no warning.
            with np.errstate(invalid="ignore", over="ignore"):
                out[:m] = (x[:m].reshape(-1, size) @ matrix).reshape(-1)
        else:
            out[:m] = (x[:m].reshape(-1, size) @ matrix).reshape(-1)
        out[m:] = x[m:]
        return out

    def forward(self, x: Any, key: Hashable) -> Any:
        """Return the rotated copy of ``x``: each full block times D·H/sqrt(size)."""
        return self._apply(x, arrays.empty_f32(x, int(x.shape[0])), transpose=False)

    def inverse(self, y: Any, out: Any) -> Any:
        """Write the inverse rotation of ``y`` into ``out``: each full block times (D·H/sqrt(size))ᵀ."""
        return self._apply(y, out, transpose=True)
