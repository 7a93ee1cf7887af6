"""PyTorch adapter with Horovod-compatible names: ``import commwire.torch as hvd``.

Example:
    >>> import commwire.torch as hvd
    >>> hvd.init()
    >>> opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()),
    ...                                named_parameters=model.named_parameters(),
    ...                                compression=hvd.Compression.fp8)
    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    >>> hvd.broadcast_optimizer_state(opt, root_rank=0)
"""

from __future__ import annotations

from ..comm.runtime import finalize, init, is_initialized, local_rank, local_size, rank, size
from .functions import (
    Average,
    Compression,
    Max,
    Min,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    synchronize,
)
from .local_sgd import DiLoCo, LoRDO, LowRankAdam, state_nbytes
from .optimizer import DistributedOptimizer

__all__ = [
    "Average",
    "Compression",
    "DiLoCo",
    "DistributedOptimizer",
    "LoRDO",
    "LowRankAdam",
    "Max",
    "Min",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "finalize",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "size",
    "state_nbytes",
    "synchronize",
]
