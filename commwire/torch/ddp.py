"""commwire's codecs for PyTorch DDP: a communication hook, and torch.distributed set up from MPI.

``ddp_hook(codec)`` returns ``(state, hook)`` for ``ddp.register_comm_hook``.
Each of DDP's gradient buckets then travels through commwire's compressed
all-reduce (any codec spec: bf16, FP8, NVFP4, with error feedback on both
phases) over the ranks of DDP's process group, on a background lane, so DDP
keeps overlapping communication with backward: the hook returns a
``torch.futures.Future`` that the lane completes. A DDP over a subgroup (replica
groups, HSDP's replicate dimension, a pipeline stage's data-parallel group)
reduces over that subgroup: pass the DDP module as ``model`` (its group is read
from it) or the group as ``process_group``, as torch's own hooks take it in
their state. The payloads travel over that process group itself (gloo, or NCCL
for CUDA buckets: commwire's torch transport), or over MPI with
``transport="mpi"``.

Error-feedback residuals are keyed by the bucket's index and its parameters'
names, so they are found again every step; DDP rebuilds its buckets once after
the first iteration (in the order gradients arrived), which starts the new
buckets' residuals from zero once. ``state.state_dict()`` /
``load_state_dict()`` and ``commwire.checkpoint`` save and restore them.

``init_process_group(backend)`` starts torch.distributed inside an mpirun /
``commwire run`` / srun job: rank and size from MPI, rank 0's address and a
free port shared by broadcast, no variables to export.

Example:
    >>> import commwire.torch as hvd
    >>> hvd.init(); hvd.init_process_group("gloo")
    >>> ddp = torch.nn.parallel.DistributedDataParallel(model)
    >>> state, hook = hvd.ddp_hook("ef+fp8-e4m3", model=model)
    >>> ddp.register_comm_hook(state, hook)
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.runtime import default_comm
from ..comm.torch_transport import init_torch_distributed

__all__ = ["DDPHookState", "ddp_hook", "init_process_group"]


def init_process_group(backend: str = "gloo", *, comm: Communicator | None = None, timeout: Any = None) -> None:
    """Initialise torch.distributed over this MPI job's ranks (call on every rank).

    Args:
        backend: "gloo" (CPU), "nccl" (one GPU per rank) or "cpu:gloo,cuda:nccl" (both).
        comm: the commwire communicator whose ranks form the group (default: the world).
        timeout: passed to ``torch.distributed.init_process_group``.

    The address is MASTER_ADDR if set (``commwire run --lab`` sets it), else
    loopback when every rank is on one node, else rank 0's host address; the
    port is MASTER_PORT if set, else a free one chosen on rank 0. A bad backend
    raises on every rank together.
    """
    init_torch_distributed(default_comm(comm).mpi, backend, timeout)


class DDPHookState:
    """What the commwire DDP hook keeps between steps: the codec (with its residuals) and statistics.

    Args:
        codec: a ``commwire.codecs`` spec or codec object ("none" for a plain all-reduce).
        comm: communicator whose ranks must be those of DDP's process group (default: a
            communicator over that group's ranks, made at the first bucket).
        names: {parameter: name} for keys that survive bucket rebuilds (else shapes are used).
        process_group: DDP's process group (default: torch.distributed's default group).
        transport: "torch" (default): the buckets travel over DDP's process group itself (gloo,
            NCCL); "mpi": over an MPI communicator of the same ranks (MPI-only setups).
        hierarchical: with a lossy codec, True reduces each bucket losslessly among the ranks of a
            host and encodes it only between hosts; an int groups that many consecutive ranks;
            None: the job's ``COMMWIRE_HIERARCHICAL`` (``commwire.codecs.hierarchical``).

    Pickles without its communicator and process group (as PowerSGDState drops its group).
    """

    def __init__(self, codec: Any = "none", comm: Communicator | None = None,
                 names: dict[torch.Tensor, str] | None = None, process_group: Any = None,
                 transport: str = "torch", hierarchical: Any = None) -> None:
        from ..codecs import get
        from ..codecs.base import Codec
        from ..codecs.hierarchical import hierarchy_setting

        hierarchy_setting(hierarchical)  # a bad value fails here, not at the first bucket
        self.hierarchical = hierarchical

        self.codec = None if codec in (None, "none") else (get(codec) if isinstance(codec, str) else codec)
        if self.codec is not None and not isinstance(self.codec, Codec):
            raise TypeError(f"codec must be a commwire codec spec or object, got {type(codec).__name__}")
        if self.codec is not None:
            from .gift import find_gift

            if find_gift(self.codec) is not None:
                raise ValueError(f"codec {self.codec.spec!r} needs layer input statistics, which a DDP hook cannot "
                                 "collect; use DistributedOptimizer(compression=..., model=model) for GIFT, or a "
                                 "codec without gift+")
        self.spec = "none" if self.codec is None else self.codec.spec
        if transport not in ("torch", "mpi"):
            raise ValueError(f"transport={transport!r} is not valid; use 'torch' (DDP's own process group) or 'mpi'")
        self.transport = transport
        self.comm = comm
        self.process_group = process_group
        self.names = {id(p): n for p, n in (names or {}).items()}
        self._params = list(names or {})  # keeps the parameters alive, so their ids stay theirs
        self.steps = 0
        self.buckets = 0
        self.bytes_sent = 0
        self.input_bytes = 0
        self._checked = False

    def key(self, bucket: Any) -> str:
        """Return the stable key of ``bucket``: its index and its parameters' names (or shapes)."""
        params = bucket.parameters()
        labels = [self.names.get(id(p)) or "x".join(map(str, p.shape)) for p in params]
        return f"ddp.bucket{bucket.index()}.{len(labels)}.{zlib.crc32(chr(0).join(labels).encode()):08x}"

    def _comm(self) -> Communicator:
        if not self._checked:
            self.comm = _group_communicator(self.process_group, self.comm, self.transport)
            self._checked = True
        return self.comm

    def state_dict(self) -> dict[str, Any]:
        """Return the codec state (error-feedback residuals) and the step count."""
        return {"spec": self.spec, "steps": self.steps,
                "codec": self.codec.state_dict() if self.codec is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the codec spec must match)."""
        if state.get("spec") != self.spec:
            raise ValueError(f"saved DDP hook state is for codec {state.get('spec')!r}, this hook runs {self.spec!r}; "
                             "build the hook with the same codec to resume")
        self.steps = int(state.get("steps", 0))
        if self.codec is not None and state.get("codec") is not None:
            self.codec.load_state_dict(state["codec"])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "comm": None, "process_group": None, "_checked": False, "_params": [],
                "names": {}}


def _group_communicator(process_group: Any, comm: Communicator | None, transport: str = "torch") -> Communicator:
    """Return the communicator over ``process_group``'s ranks: ``comm`` if given and matching, else a new one.

    torch's global ranks are commwire's world ranks (``init_process_group`` makes them so,
    and this checks it). With the torch transport the data moves over the group itself
    (``Communicator.from_process_group``); with "mpi" a subgroup gets an MPI communicator over
    the same ranks in the group's order, made by the group's members only (MPI_Comm_create_group).
    """
    import torch.distributed as dist

    world = default_comm()
    if not dist.is_initialized() or dist.get_world_size() != world.size or dist.get_rank() != world.rank:
        got = f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else "not initialised"
        raise RuntimeError(f"torch.distributed ({got}) is not commwire's ranks (rank {world.rank} of {world.size}); "
                           "start it with commwire.torch.init_process_group()")
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = list(dist.get_process_group_ranks(group))
    if comm is not None:
        if comm.size != len(ranks) or comm.rank != dist.get_rank(group):
            raise RuntimeError(f"DDP's process group (rank {dist.get_rank(group)} of {len(ranks)}: global ranks "
                               f"{ranks}) is not commwire's ranks (rank {comm.rank} of {comm.size}); pass "
                               "process_group=<DDP's group> and no comm, or a comm over the same ranks")
        return comm
    if world.rank not in ranks:
        raise RuntimeError(f"rank {world.rank} is not in DDP's process group (global ranks {ranks}); build the "
                           "hook on the ranks that run DDP over that group")
    if transport == "torch":
        return Communicator.from_process_group(group, comm=world)
    return world if ranks == list(range(world.size)) else world.new_group(ranks)


def _reduce_bucket(comm: Communicator, state: DDPHookState, buffer: torch.Tensor, key: str,
                   future: torch.futures.Future) -> None:
    """Run on the lane: average ``buffer`` in place (compressed if the state has a codec), complete ``future``."""
    try:
        if state.codec is None or state.codec.lossless:
            comm.allreduce(buffer, "avg", out=buffer, name=key)
            sent = buffer.numel() * buffer.element_size()
        else:
            from ..codecs.collective import compressed_allreduce, last_wire_bytes

            compressed_allreduce(comm, buffer, "avg", codec=state.codec, out=buffer, name=key,
                                 hierarchical=getattr(state, "hierarchical", None))
            sent = last_wire_bytes()  # this call's alone: the shared counters also count other threads' calls
        state.bytes_sent += int(sent)
        state.input_bytes += buffer.numel() * buffer.element_size()
        future.set_result(buffer)
    except BaseException as exc:  # noqa: BLE001 - the error must reach DDP's wait() on the main thread
        future.set_exception(exc)


def _future_for(buffer: torch.Tensor) -> torch.futures.Future:
    """Return the Future the lane completes with ``buffer``: CUDA-aware when the buffer is on a GPU.

    The lane reduces a CUDA bucket on a side stream and completes the Future there;
    a CUDA-aware Future records an event on that stream at ``set_result`` and makes
    DDP's stream wait for it at ``wait()``, so DDP never reads the bucket before the
    reduction's kernels have written it.
    """
    return torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()


def _hook(state, bucket):  # type: ignore[no-untyped-def] # annotated below, with objects DDP checks
    comm = state._comm()
    buffer = bucket.buffer()
    future = _future_for(buffer)
    state.buckets += 1
    if bucket.is_last():
        state.steps += 1
    comm.submit(_reduce_bucket, state, buffer, state.key(bucket), future)
    return future


def _annotate() -> None:
    # DDP's register_comm_hook checks the hook's annotations against dist.GradBucket and
    # Future[Tensor] objects; this module's postponed annotations would be strings.
    import torch.distributed as dist

    _hook.__annotations__ = {"state": DDPHookState, "bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}


_annotate()


def ddp_hook(codec: Any = "ef+fp8-e4m3", *, model: torch.nn.Module | None = None,
             comm: Communicator | None = None, process_group: Any = None, transport: str = "torch",
             hierarchical: Any = None) -> tuple[DDPHookState, Any]:
    """Return ``(state, hook)`` for ``ddp.register_comm_hook(state, hook)``.

    Args:
        codec: a ``commwire.codecs`` spec ("none", "bf16", "fp8-e4m3", "nvfp4",
            "ef+fp8-e4m3", …) or codec object; GIFT codecs need DistributedOptimizer.
        model: the DDP module (its process group is then DDP's), or the module DDP
            wraps; its parameter names key the error-feedback residuals.
        comm: the commwire communicator; it must hold the ranks of DDP's process group
            (default: one over that group's ranks).
        process_group: DDP's process group, when ``model`` is not the DDP module
            (default: the default group). A DDP over a subgroup needs one of the two.
        transport: "torch" (default: each bucket travels over DDP's own process group,
            NCCL for CUDA buckets) or "mpi" (an MPI communicator over the same ranks).
        hierarchical: True: each bucket is reduced losslessly among the ranks of a host and
            encoded only between hosts (an int: groups of that many consecutive ranks); None:
            the job's ``COMMWIRE_HIERARCHICAL``.

    Example:
        >>> state, hook = ddp_hook("ef+nvfp4", model=model)
        >>> ddp.register_comm_hook(state, hook)
    """
    names = None
    if model is not None:
        module = getattr(model, "module", model)
        names = {p: n for n, p in module.named_parameters()}
        if process_group is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            process_group = model.process_group
    return (DDPHookState(codec, comm=comm, names=names, process_group=process_group, transport=transport,
                         hierarchical=hierarchical), _hook)
