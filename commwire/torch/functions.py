"""Horovod-style tensor functions, reduction ops, compression names and broadcasts."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..comm.handle import Handle
from ..comm.runtime import world

__all__ = [
    "Average", "Sum", "Min", "Max", "Compression",
    "allreduce", "allreduce_", "allreduce_async", "synchronize", "allgather", "allgather_object",
    "broadcast", "broadcast_", "broadcast_object", "broadcast_parameters", "broadcast_optimizer_state",
]

Average = "avg"
Sum = "sum"
Min = "min"
Max = "max"


class Compression:
    """Wire formats for gradients, as codec spec strings (any ``commwire.codecs`` spec works too).

    ``fp8`` / ``nvfp4`` quantise with one scale per chunk (per 16 elements for
    NVFP4); the ``*_ef`` variants add error feedback, which carries each step's
    quantisation error into the next step.
    """

    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"
    fp8 = "fp8-e4m3"
    fp8_e5m2 = "fp8-e5m2"
    fp8_ef = "ef+fp8-e4m3"
    nvfp4 = "nvfp4"
    nvfp4_ef = "ef+nvfp4"
    gift_fp8 = "gift+fp8-e4m3"  # GIFT transform (commwire.codecs.gift); needs DistributedOptimizer(model=...)
    gift_nvfp4 = "gift+nvfp4"


def allreduce(tensor: torch.Tensor, op: str = Average, name: str | None = None,
              compression: Any = Compression.none) -> torch.Tensor:
    """Return ``tensor`` reduced over all ranks (a new tensor, same device and dtype)."""
    import commwire

    return commwire.allreduce(tensor, op, codec=compression, name=name)


def allreduce_(tensor: torch.Tensor, op: str = Average, name: str | None = None,
               compression: Any = Compression.none) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place and return it."""
    import commwire

    return commwire.allreduce(tensor, op, codec=compression, out=tensor, name=name)


def allreduce_async(tensor: torch.Tensor, op: str = Average, name: str | None = None,
                    compression: Any = Compression.none) -> Handle:
    """Start an all-reduce of ``tensor``; pass the handle to :func:`synchronize`."""
    import commwire

    return commwire.allreduce_async(tensor, op, codec=compression, name=name)


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result."""
    return handle.wait()


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (sizes may differ)."""
    return world().allgather(tensor, name=name)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Return root's ``tensor`` on every rank (a new tensor)."""
    return world().broadcast(tensor, root_rank, name=name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with root's, in place, and return it."""
    with torch.no_grad():
        return world().broadcast(tensor, root_rank, out=tensor, name=name)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Return root's picklable ``obj`` on every rank."""
    return world().broadcast_object(obj, root_rank)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Return every rank's picklable ``obj``, in rank order."""
    return world().allgather_object(obj)


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, Iterable):
        items = list(params)
        if items and not isinstance(items[0], tuple):
            raise ValueError("broadcast_parameters takes model.state_dict() or model.named_parameters(), "
                             f"got an iterable of {type(items[0]).__name__}")
    else:
        raise ValueError(f"broadcast_parameters takes a state_dict or named_parameters, got {type(params).__name__}")
    return [(n, t) for n, t in items if isinstance(t, torch.Tensor)]


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Overwrite every tensor in ``params`` (state_dict or named_parameters) with root's, in place.

    Tensors of one dtype and device travel fused in one broadcast. When
    checking is on (``commwire.init(check=True)`` / COMMWIRE_CHECK=1) a hash of
    the result is compared across ranks afterwards.
    """
    comm = world()
    named = _named_tensors(params)
    groups: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    for _, t in named:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for tensors in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else None
            if flat is None or flat.numel() == 0:
                continue
            comm.broadcast(flat, root_rank, out=flat, name="broadcast_parameters")
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n
    if comm.check is True:  # full checks: hash every parameter after the broadcast
        check_same_parameters(named)


def check_same_parameters(named: list[tuple[str, torch.Tensor]]) -> None:
    """Raise on every rank if the parameters differ between ranks, naming the first that does."""
    comm = world()
    digests = [zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()) for _, t in named]
    everyone = comm.allgather_object(digests)
    for i, (name, _) in enumerate(named):
        column = [d[i] if i < len(d) else None for d in everyone]
        if len(set(column)) > 1:
            differing = [r for r, v in enumerate(column) if v != column[0]]
            raise ValueError(f"parameter {name!r} differs between ranks after broadcast_parameters "
                             f"(ranks {differing} differ from rank 0); the models are not the same")
    if len({len(d) for d in everyone}) > 1:
        raise ValueError(f"ranks hold different numbers of parameters: {[len(d) for d in everyone]}")


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state (and hyperparameters) equal to root's."""
    comm = world()
    state = optimizer.state_dict() if comm.rank == root_rank else None
    state = comm.broadcast_object(state, root_rank)
    if comm.rank != root_rank:
        optimizer.load_state_dict(state)
