"""Schedules: when and what to communicate.

- ``SStepGram``: fold s inner steps into one Gram exchange (CA-SGD).
- ``LocalSync``: K local steps, then average pseudo-gradients (local SGD / DiLoCo).
- ``LoRDO``: low-rank optimizer states with infrequent, full-rank-corrected syncs.
"""

from .local import LocalSync, LocalSyncConfig
from .lordo import LoRDO, LoRDOConfig
from .sstep import SStepGram

__all__ = ["LoRDO", "LoRDOConfig", "LocalSync", "LocalSyncConfig", "SStepGram"]
