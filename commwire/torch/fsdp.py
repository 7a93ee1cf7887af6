"""commwire's codecs for FSDP2 (``torch.distributed.fsdp.fully_shard``): compressed reduce-scatter,
all-gather and HSDP replica all-reduce.

``compress(model, reduce_scatter=..., all_gather=..., replicate=...)`` installs
commwire's collectives on every FSDPModule of ``model`` through FSDP2's own hooks
(``set_custom_reduce_scatter``, ``set_custom_all_gather``, ``set_all_reduce_hook``):

- gradients leave each rank by commwire's compressed reduce-scatter
  (``commwire.codecs.sharded``): each peer's block encoded once on the sender,
  summed in FP32 by its owner; error feedback keyed by the module's name;
- parameters arrive by the compressed all-gather: each rank encodes its FP32
  shard (the master copy stays in full precision, so no error accumulates) and
  every rank decodes all shards, so every replica computes with the same values;
- HSDP: shard each replica with ``fully_shard(mesh=<the shard group's 1-D mesh>)``
  and pass ``replicate_group``: commwire then averages the reduce-scattered
  gradient across replicas with ``replicate``'s codec (lossless inside a shard
  group, compressed between them: fast intra-node, slow inter-node links).
  FSDP2's native HSDP (a 2-D mesh) runs its own all-reduce before any hook, so
  it is refused with ``replicate`` set.

A codec spec per collective: ``None`` leaves FSDP's own collective, ``"none"``
routes it uncompressed through commwire. The returned :class:`FSDPCompression`
holds the codecs' state (error-feedback residuals): ``state_dict()`` /
``load_state_dict()`` and ``commwire.checkpoint``.

The data moves over the process group FSDP hands each collective (torch
transport: gloo for CPU tensors, NCCL for CUDA ones), or over an MPI
communicator of the same ranks with ``transport="mpi"``.

Example:
    >>> for block in model.blocks:
    ...     fully_shard(block)
    >>> fully_shard(model)
    >>> fsdp_state = commwire.torch.fsdp.compress(model, reduce_scatter="ef+fp8-e4m3", all_gather="fp8-e4m3")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..codecs.base import Codec
from ..codecs.registry import get as get_codec
from ..codecs.sharded import check_sharded_codec, compressed_allgather, compressed_reduce_scatter
from ..comm.communicator import Communicator
from .ddp import _group_communicator

__all__ = ["FSDPCompression", "compress"]

try:  # the hooks' interfaces (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - an older torch
    AllGather = ReduceScatter = object  # type: ignore[assignment,misc]

_ROLES = ("reduce_scatter", "all_gather", "replicate")


class FSDPCompression:
    """The codecs installed on a model's FSDPModules, their communicators and their state.

    Attributes:
        codecs: role ("reduce_scatter", "all_gather", "replicate") -> codec object, for the roles set.
        modules: the FSDPModules' names (``""`` is the root).
        calls: role -> number of collectives run so far.
    """

    def __init__(self, specs: dict[str, Any], transport: str, replicate_group: Any) -> None:
        self.specs = {role: spec for role, spec in specs.items() if spec is not None}
        self.codecs: dict[str, Codec] = {}
        for role, spec in self.specs.items():
            codec = spec if isinstance(spec, Codec) else get_codec(spec)
            if role != "replicate":
                check_sharded_codec(codec, "allgather" if role == "all_gather" else "reduce_scatter")
            self.codecs[role] = codec
        self.transport = transport
        self.replicate_group = replicate_group
        self.modules: list[str] = []
        self.calls = {role: 0 for role in self.codecs}
        self._comms: dict[int, tuple[Any, Communicator]] = {}

    def comm_for(self, group: Any) -> Communicator:
        """Return the communicator over ``group``'s ranks (made once per group, on its members)."""
        found = self._comms.get(id(group))
        if found is None or found[0] is not group:
            found = self._comms[id(group)] = (group, _group_communicator(group, None, self.transport))
        return found[1]

    def state_dict(self) -> dict[str, Any]:
        """Return every role's codec state (error-feedback residuals) and call counts."""
        return {"specs": {role: codec.spec for role, codec in self.codecs.items()}, "calls": dict(self.calls),
                "codecs": {role: codec.state_dict() for role, codec in self.codecs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the same codec per role)."""
        mine = {role: codec.spec for role, codec in self.codecs.items()}
        if state.get("specs") != mine:
            raise ValueError(f"saved FSDP compression state is for codecs {state.get('specs')}, this one runs "
                             f"{mine}; call compress() with the same codecs to resume")
        for role, codec in self.codecs.items():
            codec.load_state_dict(state["codecs"][role])
        self.calls = {role: int(state.get("calls", {}).get(role, 0)) for role in self.codecs}

    def __repr__(self) -> str:
        return f"FSDPCompression({self.specs}, modules={len(self.modules)}, transport={self.transport!r})"


def _op_name(op: Any) -> str:
    if op == dist.ReduceOp.AVG:
        return "avg"
    if op == dist.ReduceOp.SUM:
        return "sum"
    raise ValueError(f"FSDP asked commwire's reduce-scatter for reduce op {op!r}; commwire runs SUM and AVG only. "
                     "Leave the gradient divide factor at its default (set_gradient_divide_factor changes the op "
                     "to PREMUL_SUM) or pass reduce_scatter=None")


class _CommwireReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP2's reduce-scatter through ``commwire.codecs.sharded.compressed_reduce_scatter``."""

    def __init__(self, owner: FSDPCompression, name: str) -> None:
        self.owner, self.name = owner, name

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        comm = self.owner.comm_for(group)
        compressed_reduce_scatter(comm, input_tensor, _op_name(op), codec=self.owner.codecs["reduce_scatter"],
                                  out=output_tensor, name=self.name)
        self.owner.calls["reduce_scatter"] += 1
        return None  # done: FSDP treats the collective as synchronous


class _CommwireAllGather(AllGather):  # type: ignore[misc,valid-type]
    """FSDP2's parameter all-gather through ``commwire.codecs.sharded.compressed_allgather``."""

    def __init__(self, owner: FSDPCompression, name: str) -> None:
        self.owner, self.name = owner, name

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        if not input_tensor.is_floating_point():
            raise TypeError(f"FSDP's all-gather input for {self.name!r} is {input_tensor.dtype} (parameters that "
                            "encode themselves, e.g. float8 training's fsdp_pre_all_gather): already compressed; "
                            "pass all_gather=None")
        comm = self.owner.comm_for(group)
        n = int(input_tensor.numel())
        compressed_allgather(comm, input_tensor.reshape(-1), codec=self.owner.codecs["all_gather"],
                             counts=[n] * comm.size, out=output_tensor.reshape(-1), name=self.name)
        self.owner.calls["all_gather"] += 1
        return None


def _replicate_hook(owner: FSDPCompression, name: str) -> Any:
    from ..codecs.collective import compressed_allreduce

    def hook(reduce_output: torch.Tensor) -> None:
        comm = owner.comm_for(owner.replicate_group)
        compressed_allreduce(comm, reduce_output, "avg", codec=owner.codecs["replicate"], out=reduce_output,
                             name=name)
        owner.calls["replicate"] += 1

    return hook


def compress(model: torch.nn.Module, reduce_scatter: Any = "ef+fp8-e4m3", all_gather: Any = "fp8-e4m3",
             replicate: Any = None, *, replicate_group: Any = None, transport: str = "torch") -> FSDPCompression:
    """Install commwire's compressed collectives on every FSDPModule of ``model``; return their state.

    Call it on every rank, after ``fully_shard`` and before the first forward.

    Args:
        model: a module containing FSDPModules (``fully_shard`` applied to it or its blocks).
        reduce_scatter: codec of the gradient reduce-scatter (spec or codec object); ``None`` keeps FSDP's.
        all_gather: codec of the parameter all-gather; ``None`` keeps FSDP's. Error feedback and
            GIFT are refused (see ``commwire.codecs.sharded``).
        replicate: codec of the all-reduce across HSDP replicas; needs ``replicate_group``.
        replicate_group: the process group (or 1-D DeviceMesh) joining this rank with the ranks
            holding the same shard in the other replicas.
        transport: "torch" (the process group FSDP uses) or "mpi" (an MPI communicator of its ranks).

    Returns:
        An :class:`FSDPCompression`: ``state_dict()``/``load_state_dict()``, counters of calls.
    """
    if transport not in ("torch", "mpi"):
        raise ValueError(f"transport={transport!r} is not valid; use 'torch' (FSDP's process groups) or 'mpi'")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compress() takes the model (a torch.nn.Module), got {type(model).__name__}")
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no FSDPModule: apply torch.distributed.fsdp.fully_shard to "
                         "the model (and its blocks) before compress()")
    if replicate is not None and replicate_group is None:
        raise ValueError(f"replicate={replicate!r} needs replicate_group=: the process group (or 1-D DeviceMesh) "
                         "across HSDP replicas; shard each replica with fully_shard(mesh=<its shard mesh>)")
    if replicate is None and replicate_group is not None:
        raise ValueError("replicate_group= is set but replicate=None: pass replicate='none' (uncompressed) or a "
                         "codec spec for the all-reduce across replicas")
    group = replicate_group
    if group is not None and hasattr(group, "get_group"):  # a DeviceMesh
        group = group.get_group()
    owner = FSDPCompression({"reduce_scatter": reduce_scatter, "all_gather": all_gather, "replicate": replicate},
                            transport, group)
    for name, module in modules:
        label = name or "root"
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            if replicate is not None and getattr(param_group, "_is_hsdp", False):
                raise ValueError(f"FSDPModule {label!r} runs FSDP2's native HSDP (a 2-D mesh), whose own "
                                 "all-reduce runs before any hook; shard each replica with fully_shard(mesh="
                                 "mesh['shard']) and pass replicate_group=mesh['replicate'] to compress it")
        if reduce_scatter is not None:
            module.set_custom_reduce_scatter(_CommwireReduceScatter(owner, f"fsdp.{label}.rs"))
        if all_gather is not None:
            module.set_custom_all_gather(_CommwireAllGather(owner, f"fsdp.{label}.ag"))
        if replicate is not None:
            module.set_all_reduce_hook(_replicate_hook(owner, f"fsdp.{label}.replicate"))
        owner.modules.append(name)
    return owner
