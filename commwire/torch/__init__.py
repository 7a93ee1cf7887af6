"""PyTorch adapter with Horovod's names: ``import commwire.torch as hvd``.

Every public name of ``horovod.torch`` is here with Horovod's semantics, each
mapped onto one commwire implementation: process sets are commwire
Communicators (commwire.torch.basics), collectives run on their background
lane (commwire.torch.mpi_ops), ``grouped_*`` travel fused, Compressors wrap
the codec layer (commwire.torch.compression), and DistributedOptimizer fuses
gradients into buckets that reduce while backward runs
(commwire.torch.optimizer). commwire adds LoRDO, DiLoCo, GIFT compressions,
error-feedback codecs, a DDP communication hook (commwire.torch.ddp) and compressed FSDP2
collectives (commwire.torch.fsdp).

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

from typing import Any

from .basics import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    global_process_set,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from .compression import CodecCompressor, Compression, Compressor, FP16Compressor, NoneCompressor
from .ddp import DDPHookState, ddp_hook, init_process_group
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .local_sgd import DiLoCo, LoRDO, LowRankAdam, state_nbytes
from .mpi_ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from .optimizer import DistributedOptimizer
from . import elastic  # noqa: E402 - hvd.elastic, as horovod.torch has it

__all__ = [
    "Adasum", "Average", "CodecCompressor", "Compression", "Compressor", "DDPHookState", "DiLoCo",
    "DistributedOptimizer",
    "FP16Compressor", "HorovodInternalError", "LoRDO", "LowRankAdam", "Max", "Min", "NoneCompressor",
    "ProcessSet", "Product", "Sum", "SyncBatchNorm", "elastic",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "ddp_hook", "gloo_built", "gloo_enabled",
    "global_process_set", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "init_process_group", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "state_nbytes", "stop_timeline", "synchronize",
]


def __getattr__(name: str) -> Any:
    # SyncBatchNorm subclasses a torch module class: build it on first use.
    if name == "SyncBatchNorm":
        from .sync_batch_norm import SyncBatchNorm

        return SyncBatchNorm
    raise AttributeError(f"module 'commwire.torch' has no attribute {name!r}")
