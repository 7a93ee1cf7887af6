"""A small stand-in for torchvision, for running Horovod's PyTorch examples where no torchvision wheel fits.

Only what those examples touch: ``models.<name>()`` (small convolutional
networks under torchvision's model names), ``datasets.MNIST`` and
``datasets.ImageFolder`` (synthetic, learnable image sets with their
interfaces) and ``transforms`` (Compose, ToTensor, Normalize, Resize,
CenterCrop, RandomResizedCrop, RandomHorizontalFlip). It is test scaffolding, not torchvision: the
models are much smaller than their namesakes, so images/s figures from it say
nothing about ResNet-50.
"""

from . import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
__version__ = "0.0-commwire-standin"
