"""A small stand-in for torchvision, for running Horovod's PyTorch examples where no torchvision wheel fits.

Only what those examples touch: ``models.<name>()`` (small convolutional
networks under torchvision's model names), ``datasets.MNIST`` (a synthetic,
learnable 28x28 digit set with MNIST's interface) and ``transforms``
(Compose, ToTensor, Normalize). It is test scaffolding, not torchvision: the
models are much smaller than their namesakes, so images/s figures from it say
nothing about ResNet-50.
"""

from . import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
__version__ = "0.0-commwire-standin"
