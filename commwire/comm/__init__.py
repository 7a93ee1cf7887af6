"""Core layer: the Communicator over mpi4py, array adapters, handles, counters."""

from .check import CollectiveMismatchError
from .communicator import REDUCE_OPS, Communicator
from .handle import Handle, blocked_seconds
from .runtime import (
    cuda_aware,
    default_comm,
    finalize,
    init,
    install_abort_hook,
    is_initialized,
    local_rank,
    local_size,
    new_group,
    rank,
    size,
    stats,
    thread_level,
    world,
)
from .stragglers import StragglerMonitor, StragglerReport

__all__ = [
    "CollectiveMismatchError",
    "Communicator",
    "Handle",
    "REDUCE_OPS",
    "StragglerMonitor",
    "StragglerReport",
    "blocked_seconds",
    "cuda_aware",
    "default_comm",
    "finalize",
    "init",
    "install_abort_hook",
    "is_initialized",
    "local_rank",
    "local_size",
    "new_group",
    "rank",
    "size",
    "stats",
    "thread_level",
    "world",
]
