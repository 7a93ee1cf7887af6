"""Small image classifiers under torchvision's model names (3x224x224 input, 1000 classes by default)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["resnet50", "resnet18", "resnet101", "vgg16", "alexnet", "mobilenet_v2", "SmallConvNet"]


class SmallConvNet(nn.Module):
    """Three strided convolutions, global pooling and a linear classifier."""

    def __init__(self, width: int = 16, num_classes: int = 1000) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=4, padding=3), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.BatchNorm2d(4 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


def _factory(width: int):
    def make(num_classes: int = 1000, **_: object) -> SmallConvNet:
        return SmallConvNet(width, num_classes)

    return make


resnet18 = _factory(8)
resnet50 = _factory(16)
resnet101 = _factory(24)
vgg16 = _factory(16)
alexnet = _factory(8)
mobilenet_v2 = _factory(8)
