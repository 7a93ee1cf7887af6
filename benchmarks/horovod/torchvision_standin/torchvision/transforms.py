"""Compose, ToTensor, Normalize and the crops and flips of the ImageNet example, as torchvision spells them.

Images before ToTensor are HxW or HxWxC uint8 arrays (torchvision's are PIL
images); resizing takes the nearest pixel. Random choices use torch's
generator, as torchvision's do.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import math

import numpy as np
import torch

__all__ = ["Compose", "ToTensor", "Normalize", "Resize", "CenterCrop", "RandomResizedCrop",
           "RandomHorizontalFlip"]


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


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    rows = (np.arange(height) * image.shape[0] // height).clip(0, image.shape[0] - 1)
    cols = (np.arange(width) * image.shape[1] // width).clip(0, image.shape[1] - 1)
    return image[rows][:, cols]


class Resize:
    """Resize the shorter side to ``size`` (an int), or to ``size`` = (height, width)."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = size

    def __call__(self, image: np.ndarray) -> np.ndarray:
        if not isinstance(self.size, int):
            return _resize(image, *self.size)
        h, w = image.shape[:2]
        scale = self.size / min(h, w)
        return _resize(image, round(h * scale), round(w * scale))


class CenterCrop:
    """Cut the central ``size`` x ``size`` patch."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: np.ndarray) -> np.ndarray:
        h, w = image.shape[:2]
        top, left = max(0, (h - self.size) // 2), max(0, (w - self.size) // 2)
        return image[top:top + self.size, left:left + self.size]


class RandomResizedCrop:
    """Cut a random patch (``scale`` of the area, aspect ``ratio``) and resize it to ``size`` x ``size``."""

    def __init__(self, size: int, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, image: np.ndarray) -> np.ndarray:
        h, w = image.shape[:2]
        for _ in range(10):
            area = h * w * float(torch.empty(1).uniform_(*self.scale))
            aspect = math.exp(float(torch.empty(1).uniform_(math.log(self.ratio[0]), math.log(self.ratio[1]))))
            cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                top = int(torch.randint(0, h - ch + 1, (1,)))
                left = int(torch.randint(0, w - cw + 1, (1,)))
                return _resize(image[top:top + ch, left:left + cw], self.size, self.size)
        return _resize(image, self.size, self.size)


class RandomHorizontalFlip:
    """Mirror left-right with probability ``p``."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: np.ndarray) -> np.ndarray:
        return image[:, ::-1] if float(torch.rand(1)) < self.p else image
