"""Schedules: when and what to communicate.

- ``EveryStep``: average the gradients at every step (plain data parallelism).
- ``SStepGram``: fold s inner steps into one Gram exchange (CA-SGD).
- ``LocalSync``: K local steps, then average pseudo-gradients (local SGD / DiLoCo).
- ``StreamingSync``: LocalSync in P fragments that take turns, each in flight for τ steps (Streaming DiLoCo).
- ``LoRDO`` (``LoRDOSchedule``): low-rank optimizer states with infrequent, full-rank-corrected syncs;
  its update rule is :mod:`commwire.optim.lordo`.

Each implements :class:`Schedule`: ``due(step)``, ``steps``/``syncs``,
``bytes_per_sync``/``messages_per_sync`` and ``state_dict()``/``load_state_dict()``.
"""

from ..optim.lordo import LoRDOConfig
from .base import Schedule, Ticker
from .every import EveryStep
from .local import LocalSync, LocalSyncConfig
from .lordo import LoRDO, LoRDOSchedule
from .sstep import SStepGram
from .streaming import StreamingSync, split_fragments

__all__ = ["EveryStep", "LoRDO", "LoRDOConfig", "LoRDOSchedule", "LocalSync", "LocalSyncConfig", "SStepGram",
           "Schedule", "StreamingSync", "Ticker", "split_fragments"]
