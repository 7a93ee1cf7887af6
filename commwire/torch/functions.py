"""Broadcast model and optimizer state, and Python objects, as Horovod's functions do.

Tensors travel fused (one broadcast per dtype and device); Python objects are
pickled (``broadcast_object``/``allgather_object``: only between the job's own
ranks, never from files).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..comm.communicator import Communicator
from .process_sets import comm_of, global_process_set
from .mpi_ops import _call, _rooted

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
           "check_same_parameters"]


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        items = [p if isinstance(p, tuple) else (f"param.{i}", p) for i, p in enumerate(params)]
    else:
        raise ValueError(f"broadcast_parameters takes a state_dict, named_parameters() or a list of tensors, "
                         f"got {type(params).__name__}")
    bad = [n for n, t in items if not isinstance(t, torch.Tensor)]
    if bad:
        raise ValueError(f"broadcast_parameters got non-tensor entries {bad[:5]}; pass tensors only")
    return [(str(n), t) for n, t in items]


def _broadcast_fused(comm: Communicator, tensors: list[torch.Tensor], root: Any, name: str | None = None) -> None:
    """Overwrite ``tensors`` with root's: one broadcast per (dtype, device), in a fixed order (runs on a lane)."""
    groups: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for k, (key, group) in enumerate(sorted(groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1])))):
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            if flat.numel() == 0:
                continue
            comm.broadcast(flat, root, out=flat, name=f"{name or 'broadcast'}.{k}")
            for t, piece in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(piece.view_as(t))


def broadcast_parameters(params: Any, root_rank: int = 0, process_set: Any = global_process_set) -> None:
    """Overwrite every tensor in ``params`` (state_dict, named_parameters or a list) with root's, in place.

    Tensors of one dtype and device travel fused in one broadcast. With full
    checking (``commwire.init(check=True)``) a hash of every tensor is compared
    across ranks afterwards.
    """
    named = _named_tensors(params)
    tensors, root = _rooted([t for _, t in named], root_rank, process_set)
    if not isinstance(tensors, list):  # root_rank is not a member: every member raises
        _call(process_set, Communicator.broadcast, tensors, 0, name="broadcast_parameters")
    _call(process_set, _broadcast_fused, tensors, root, name="broadcast_parameters")
    from ..comm.runtime import world

    if world().check is True:
        check_same_parameters(named, process_set)


def check_same_parameters(named: list[tuple[str, torch.Tensor]], process_set: Any = global_process_set) -> None:
    """Raise on every rank if the tensors differ between ranks, naming the first that does."""
    digests = [zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()) for _, t in named]
    everyone = allgather_object(digests, process_set=process_set)
    if len({len(d) for d in everyone}) > 1:
        raise ValueError(f"ranks hold different numbers of parameters: {[len(d) for d in everyone]}")
    for i, (name, _) in enumerate(named):
        column = [d[i] for d in everyone]
        if len(set(column)) > 1:
            differing = [r for r, v in enumerate(column) if v != column[0]]
            raise ValueError(f"parameter {name!r} differs between ranks after broadcast_parameters "
                             f"(ranks {differing} differ from rank 0); the models are not the same")


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """Return root's picklable ``obj`` on every member (``root_rank``: a global rank)."""
    ranks = (global_process_set if process_set is None else process_set).ranks
    # A root outside the process set fails the core's root check on every member alike.
    root = ranks.index(root_rank) if root_rank in ranks else f"global rank {root_rank!r}, not in {ranks}"
    # No default name from the object's type (as Horovod makes): root's and the others' may differ.
    return _call(process_set, Communicator.broadcast_object, obj, root, name=name)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """Return every member's picklable ``obj``, in rank order."""
    return _call(process_set, Communicator.allgather_object, obj, name=name)


# --------------------------------------------------------------------------- optimizer state
def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state by one step on zero gradients (no communication)."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                zeros = torch.zeros_like(p)
                p.grad = zeros.to_sparse() if sparse else zeros
    optimizer.step()


def _placeholders(state: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace every tensor in ``state`` by ("tensor", index, shape, dtype) and collect the tensors."""
    if isinstance(state, torch.Tensor):
        tensors.append(state)
        return ("__tensor__", len(tensors) - 1, tuple(state.shape), str(state.dtype).replace("torch.", ""))
    if isinstance(state, Mapping):
        return {k: _placeholders(v, tensors) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_placeholders(v, tensors) for v in state)
    return state


def _rebuild(state: Any, tensors: list[torch.Tensor], device: Any) -> Any:
    """Invert ``_placeholders``: allocate a tensor for each placeholder (filled later by the broadcast)."""
    if isinstance(state, tuple) and len(state) == 4 and state[0] == "__tensor__":
        t = torch.empty(state[2], dtype=getattr(torch, state[3]), device=device)
        tensors.append(t)
        return t
    if isinstance(state, Mapping):
        return {k: _rebuild(v, tensors, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_rebuild(v, tensors, device) for v in state)
    return state


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, model: Any = None,
                              process_set: Any = global_process_set) -> None:
    """Make every member's optimizer state and hyperparameters equal to root's.

    A fresh optimizer first gets its state from one step on zero gradients
    (so every rank holds the same structure, as Horovod does); then the
    structure and the scalars travel pickled and the state tensors fused.
    """
    from .optimizer import DistributedOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if isinstance(inner, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (its closure-based state is not portable); "
                         "broadcast the model and recreate the optimizer on every rank")
    if len(inner.state_dict()["state"]) == 0:
        _initialise_state(inner)
    comm = comm_of(process_set)
    ranks = (global_process_set if process_set is None else process_set).ranks
    is_root = root_rank in ranks and ranks.index(root_rank) == comm.rank
    tensors: list[torch.Tensor] = []
    layout = _placeholders(inner.state_dict(), tensors) if is_root else None
    layout = broadcast_object(layout, root_rank, name="broadcast_optimizer_state", process_set=process_set)
    if is_root:
        _call(process_set, _broadcast_fused, tensors, comm.rank, name="broadcast_optimizer_state")
        return
    device = next((p.device for g in inner.param_groups for p in g["params"]), torch.device("cpu"))
    received: list[torch.Tensor] = []
    state = _rebuild(layout, received, device)
    _call(process_set, _broadcast_fused, received, ranks.index(root_rank), name="broadcast_optimizer_state")
    inner.load_state_dict(state)  # a DistributedOptimizer sees it: it shares the wrapped optimizer's groups
