"""commwire: communication middleware for distributed training over MPI.

Example:
    >>> import commwire as cw, numpy as np
    >>> cw.init()
    >>> cw.allreduce(np.ones(3) * cw.rank(), op="sum")

Collectives accept numpy arrays, torch tensors and cupy arrays and return the
same kind of array on the same device. ``codec=`` compresses what goes on the
wire (see ``commwire.codecs``). torch and cupy are imported only when such an
array is passed in; ``commwire.DistributedOptimizer`` (commwire.torch's)
resolves on first use.
"""

from __future__ import annotations

from typing import Any

from . import _config, checkpoint
from .comm import (
    CollectiveMismatchError,
    Communicator,
    Handle,
    StragglerMonitor,
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

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError",
    "Communicator",
    "DistributedOptimizer",
    "Handle",
    "StragglerMonitor",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "checkpoint",
    "cuda_aware",
    "finalize",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "new_group",
    "rank",
    "reduce_scatter",
    "reduce_scatter_async",
    "run",
    "size",
    "stats",
    "thread_level",
    "world",
]


def allreduce(
    x: Any,
    op: str = "sum",
    *,
    codec: Any = None,
    out: Any = None,
    name: str | None = None,
    comm: Communicator | None = None,
    hierarchical: Any = None,
) -> Any:
    """Reduce ``x`` over all ranks; with ``codec`` the wire carries encoded payloads.

    Args:
        x: numpy array, torch tensor or cupy array.
        op: "sum", "avg", "min" or "max" (lossy codecs allow only sum and avg).
        codec: None, a codec spec string (e.g. "fp8-e4m3", "ef+nvfp4") or a codec object.
        out: array to write the result into (``out=x`` for in place).
        name: label for statistics, the timeline and codec state.
        comm: communicator (default: the world).
        hierarchical: with a codec: True reduces losslessly inside each node and encodes only
            across nodes; an int groups that many consecutive ranks instead; None: the
            ``COMMWIRE_HIERARCHICAL`` default (flat unless set).
    """
    if codec is None or codec == "none":
        return default_comm(comm).allreduce(x, op, out=out, name=name)
    from .codecs.collective import compressed_allreduce

    return compressed_allreduce(default_comm(comm), x, op, codec=codec, out=out, name=name, hierarchical=hierarchical)


def allreduce_async(
    x: Any,
    op: str = "sum",
    *,
    codec: Any = None,
    out: Any = None,
    name: str | None = None,
    comm: Communicator | None = None,
    hierarchical: Any = None,
) -> Handle:
    """Start an all-reduce (optionally compressed); ``wait()`` on the handle gives the result."""
    if codec is None or codec == "none":
        return default_comm(comm).allreduce_async(x, op, out=out, name=name)
    from .codecs.collective import compressed_allreduce_async

    return compressed_allreduce_async(default_comm(comm), x, op, codec=codec, out=out, name=name,
                                      hierarchical=hierarchical)


def allgather(x: Any, *, codec: Any = None, counts: Any = None, name: str | None = None,
              comm: Communicator | None = None) -> Any:
    """Concatenate every rank's ``x`` along the first dimension (sizes may differ).

    With ``codec`` (e.g. "fp8-e4m3") each rank's rows travel encoded and every rank decodes
    every payload (``commwire.codecs.sharded.compressed_allgather``); ``counts`` (every
    rank's rows, the same list everywhere) saves the exchange of sizes.
    """
    if codec is None or codec == "none":
        return default_comm(comm).allgather(x, name=name)
    from .codecs.sharded import compressed_allgather

    return compressed_allgather(default_comm(comm), x, codec=codec, counts=counts, name=name)


def allgather_async(x: Any, *, codec: Any = None, counts: Any = None, name: str | None = None,
                    comm: Communicator | None = None) -> Handle:
    """Start an all-gather (optionally compressed); ``wait()`` on the handle gives the concatenation."""
    if codec is None or codec == "none":
        return default_comm(comm).allgather_async(x, name=name)
    from .codecs.sharded import compressed_allgather_async

    return compressed_allgather_async(default_comm(comm), x, codec=codec, counts=counts, name=name)


def broadcast(x: Any, root: int = 0, *, out: Any = None, name: str | None = None,
              comm: Communicator | None = None) -> Any:
    """Return root's ``x`` on every rank (``out=x`` overwrites ``x`` in place)."""
    return default_comm(comm).broadcast(x, root, out=out, name=name)


def broadcast_async(x: Any, root: int = 0, *, out: Any = None, name: str | None = None,
                    comm: Communicator | None = None) -> Handle:
    """Start a broadcast from ``root``; ``wait()`` on the handle gives the array."""
    return default_comm(comm).broadcast_async(x, root, out=out, name=name)


def reduce_scatter(x: Any, op: str = "sum", *, codec: Any = None, counts: Any = None, name: str | None = None,
                   comm: Communicator | None = None) -> Any:
    """Reduce ``x`` over ranks and return this rank's block of rows.

    ``counts`` gives each rank's rows (default ``numpy.array_split``'s rule). With ``codec``
    (e.g. "ef+fp8-e4m3") each rank sends its peers' blocks encoded and the owner sums them
    in FP32 (``commwire.codecs.sharded.compressed_reduce_scatter``).
    """
    if codec is None or codec == "none":
        return default_comm(comm).reduce_scatter(x, op, name=name, counts=counts)
    from .codecs.sharded import compressed_reduce_scatter

    return compressed_reduce_scatter(default_comm(comm), x, op, codec=codec, counts=counts, name=name)


def reduce_scatter_async(x: Any, op: str = "sum", *, codec: Any = None, counts: Any = None, name: str | None = None,
                         comm: Communicator | None = None) -> Handle:
    """Start a reduce-scatter (optionally compressed); ``wait()`` on the handle gives this rank's block."""
    if codec is None or codec == "none":
        return default_comm(comm).reduce_scatter_async(x, op, name=name, counts=counts)
    from .codecs.sharded import compressed_reduce_scatter_async

    return compressed_reduce_scatter_async(default_comm(comm), x, op, codec=codec, counts=counts, name=name)


def alltoall(x: Any, *, name: str | None = None, comm: Communicator | None = None) -> Any:
    """Send block i of ``x``'s rows to rank i and return the blocks received."""
    return default_comm(comm).alltoall(x, name=name)


def broadcast_object(obj: Any, root: int = 0, *, comm: Communicator | None = None) -> Any:
    """Return root's picklable ``obj`` on every rank."""
    return default_comm(comm).broadcast_object(obj, root)


def allgather_object(obj: Any, *, comm: Communicator | None = None) -> list[Any]:
    """Return every rank's picklable ``obj`` as a list in rank order."""
    return default_comm(comm).allgather_object(obj)


def barrier(*, comm: Communicator | None = None) -> None:
    """Block until every rank reaches this call."""
    default_comm(comm).barrier()


def __getattr__(name: str) -> Any:
    if name == "run":  # imported on first use: each rank of commwire.run runs that module as its program
        from .runfunc import run

        return run
    # torch-dependent names resolve on first use, so `import commwire` never imports torch.
    if name == "DistributedOptimizer":
        try:
            from .torch import DistributedOptimizer
        except ImportError as exc:
            raise ImportError("commwire.DistributedOptimizer needs torch: pip install 'commwire[torch]'") from exc
        return DistributedOptimizer
    raise AttributeError(f"module 'commwire' has no attribute {name!r}")


if _config.env_bool("COMMWIRE_RUN"):
    # Launched by `commwire run`: a rank that raises must abort the job even
    # if it fails before calling init().
    install_abort_hook()
