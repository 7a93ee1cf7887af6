"""Synthetic stand-ins for MNIST and ImageFolder: images drawn from fixed class templates plus noise.

Each class has its own template, so a small network learns it within an
epoch; images are generated from the seed of the split, so every rank sees
the same data without files.

- ``MNIST``: 28x28 grey digits; sizes COMMWIRE_STANDIN_MNIST_TRAIN /
  COMMWIRE_STANDIN_MNIST_TEST (default 4096 / 1024).
- ``ImageFolder``: 64x64 RGB images of 10 classes (HxWxC uint8 arrays, which
  the stand-in transforms take where torchvision's take PIL images); the
  directory is not read, its path seeds the split; size
  COMMWIRE_STANDIN_IMAGEFOLDER (default 512).
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Callable

import numpy as np

__all__ = ["MNIST", "ImageFolder"]


class MNIST:
    """MNIST's interface (root, train, download, transform, target_transform) over synthetic digits."""

    def __init__(self, root: str, train: bool = True, download: bool = False,
                 transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None) -> None:
        n = int(os.environ.get("COMMWIRE_STANDIN_MNIST_TRAIN" if train else "COMMWIRE_STANDIN_MNIST_TEST",
                               4096 if train else 1024))
        templates = np.random.default_rng(2024).random((10, 28, 28)) > 0.7
        rng = np.random.default_rng(1 if train else 2)
        self.targets = rng.integers(0, 10, n)
        noise = rng.random((n, 28, 28)) < 0.1
        self.data = ((templates[self.targets] ^ noise) * 255).astype(np.uint8)
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        image, target = self.data[i], int(self.targets[i])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class ImageFolder:
    """ImageFolder's interface (root, transform, target_transform, classes) over synthetic RGB images."""

    def __init__(self, root: str, transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, **_: Any) -> None:
        n = int(os.environ.get("COMMWIRE_STANDIN_IMAGEFOLDER", 512))
        self.classes = [f"class{c}" for c in range(10)]
        templates = np.random.default_rng(2025).integers(0, 256, (10, 8, 8, 3))
        rng = np.random.default_rng(zlib.crc32(os.fspath(root).encode()))
        self.targets = rng.integers(0, 10, n).tolist()
        self._noise_seed = int(rng.integers(1 << 31))
        self._templates = templates.repeat(8, axis=1).repeat(8, axis=2)  # 64x64 blocks of 8x8
        self.root, self.transform, self.target_transform = root, transform, target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        target = self.targets[i]
        noise = np.random.default_rng(self._noise_seed + i).integers(-40, 41, (64, 64, 3))
        image = np.clip(self._templates[target] + noise, 0, 255).astype(np.uint8)
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
