"""Schedules: when and what to communicate (s-step Gram exchange)."""

from .sstep import SStepGram

__all__ = ["SStepGram"]

from .local import LocalSync, LocalSyncConfig
from .lordo import LoRDO, LoRDOConfig

__all__ += ["LocalSync", "LocalSyncConfig", "LoRDO", "LoRDOConfig"]
