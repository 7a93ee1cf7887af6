"""A synthetic MNIST: 28x28 grey digits drawn from ten fixed stroke templates plus noise.

Each class has its own template, so a small network learns it within an
epoch; images are generated from the seed of the split, so every rank sees
the same data without files. Sizes: COMMWIRE_STANDIN_MNIST_TRAIN /
COMMWIRE_STANDIN_MNIST_TEST (default 4096 / 1024).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

__all__ = ["MNIST"]


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
