"""Optimizer maths, framework-agnostic: update rules on numpy arrays and torch tensors alike.

- :mod:`commwire.optim.lordo`: LoRDO's low-rank Adam in a global subspace (error
  feedback, the full-rank QH term, basis refresh), plain AdamW, global-norm clipping.

No schedule lives here: :mod:`commwire.schedules` decides when ranks communicate,
and ``commwire.torch`` puts torch's optimizer interface on both.
"""

from . import lordo
from .lordo import *  # noqa: F401,F403 - the package re-exports exactly lordo.__all__

__all__ = list(lordo.__all__)
