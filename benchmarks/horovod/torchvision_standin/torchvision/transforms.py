"""Compose, ToTensor and Normalize, as torchvision.transforms spells them."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["Compose", "ToTensor", "Normalize"]


class Compose:
    """Apply transforms in order."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """Turn an HxW (or HxWxC) uint8 array into a CxHxW float tensor in [0, 1]."""

    def __call__(self, image: Any) -> torch.Tensor:
        a = np.asarray(image, dtype=np.float32) / 255.0
        if a.ndim == 2:
            a = a[None]
        else:
            a = a.transpose(2, 0, 1)
        return torch.from_numpy(np.ascontiguousarray(a))


class Normalize:
    """Subtract ``mean`` and divide by ``std`` per channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return (t - self.mean) / self.std
