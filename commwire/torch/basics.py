"""Horovod's lifecycle and introspection, over commwire's core.

Process sets (commwire.torch.process_sets) are commwire Communicators; the
global process set is one over the whole world (a duplicate, so its
collectives never interleave with ``commwire``'s own).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any

from ..comm import runtime
from ..comm.communicator import Communicator
from . import process_sets as _ps
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
]

Average = "avg"
Sum = "sum"
Adasum = "adasum"
Min = "min"
Max = "max"
Product = "prod"


class HorovodInternalError(RuntimeError):
    """A collective failed inside the communication layer (Horovod's name; commwire raises builtin types)."""


_lock = threading.Lock()
_state: dict[str, Any] = {}


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None, **kwargs: Any) -> None:
    """Initialise commwire (once) and Horovod's process sets.

    Called again on an initialised job, ``init()`` is a synchronisation point
    of the global process set: each rank waits there until every rank has
    called it, and a rank that meanwhile runs other collectives of the global
    set (blocking or asynchronous) gets a ``CollectiveMismatchError`` from each
    instead of pairing them with whatever the waiting ranks do next. So a
    failure that sent some ranks ahead (an assertion that fails on one rank
    only) costs the ranks behind the rest of that piece of work, not every
    collective after it. Horovod's test suite calls ``init()`` at the start of
    every test; collectives of other process sets are not covered.

    Args:
        comm: None (MPI_COMM_WORLD), an mpi4py communicator (then also
            ``global_process_set.mpi_comm``), or a list of world ranks to run on
            (only those ranks may call init).
        process_sets: process sets to register now (see
            commwire.torch.process_sets for Horovod's rules: sets registered
            already are bound, duplicates within the list raise a ValueError),
            or "dynamic" (every set may be added later with
            ``add_process_set``; always allowed).
        **kwargs: passed to ``commwire.init`` (check, timeline, timeout, ...).
    """
    from . import _env

    mpi_comm = comm if hasattr(comm, "Get_rank") else None
    if comm is not None and mpi_comm is None:
        comm = _ranks_comm(list(comm))
    if not runtime.is_initialized():
        runtime.init(comm=comm, **{**_env.init_kwargs(), **kwargs})
    else:
        runtime.init(comm=comm, **kwargs)
    with _lock:
        again = _state.get("world") is runtime.world()
    if again:
        _resync(global_process_set.comm)
        _ps.register(process_sets)
        return
    with _lock:
        world = runtime.world()
        _ps.start(world, world.duplicate(check=True), mpi_comm)
        # Everything collective is made now, in the same order on every rank (made lazily, a rank
        # asking for local_rank() while another starts a collective would deadlock).
        _state.update(world=world, cross=world.split(color=world.node().rank, key=world.rank))
        _ps.start_lane(global_process_set.comm)
        _env.apply_at_init()
    _ps.register(process_sets)


def _resync(comm: Communicator) -> None:
    """Wait until every rank resyncs ``comm`` and its lane (both at once: a rank behind may be in either)."""
    from ..comm.lane import existing_lane

    lane = existing_lane(comm)
    handle = lane.submit(Communicator.resync, label="init") if lane is not None else None
    comm.resync()
    if handle is not None:
        handle.wait()


def _ranks_comm(ranks: list[int]) -> Any:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_rank() not in ranks:
        raise ValueError(f"init(comm={ranks}) was called on rank {world.Get_rank()}, which is not in the list; "
                         "call init only on the listed ranks, or include this one")
    group = world.Get_group().Incl(ranks)
    try:
        return world.Create_group(group)
    finally:
        group.Free()


def _world() -> Communicator:
    if "world" not in _state or not runtime.is_initialized():
        raise ValueError("Horovod has not been initialized; call hvd.init() first")
    return _state["world"]


def shutdown() -> None:
    """Shut commwire down on this rank (``init()`` may be called again)."""
    _forget()
    runtime.finalize()


def rebuild_after_reform() -> None:
    """Rebuild the global process set on commwire's re-formed world (commwire.elastic, in process).

    The old sets' communicators were revoked by the re-forming: their lanes are
    stopped without any collective, the registry is emptied (sets added with
    ``add_process_set`` must be added again) and ``init()`` builds the global set
    on the survivors.
    """
    _forget()
    init()


def _forget() -> None:
    """Forget every process set (stopping their lanes, no collective) and the world."""
    from ..comm.lane import close_lane

    with _lock:
        for comm in _ps.clear():
            close_lane(comm)
        _state.clear()


def is_initialized() -> bool:
    """Return whether ``init()`` has been called (and not shut down)."""
    return runtime.is_initialized() and "world" in _state


def rank() -> int:
    """Return this process's rank."""
    return _world().rank


def size() -> int:
    """Return the number of ranks."""
    return _world().size


def local_rank() -> int:
    """Return this process's rank among the ranks on its node."""
    return _world().node().rank


def local_size() -> int:
    """Return the number of ranks on this node."""
    return _world().node().size


def _cross() -> Communicator:
    _world()
    return _state["cross"]


def cross_rank() -> int:
    """Return the rank of this node among the nodes (the ranks with this local rank)."""
    return _cross().rank


def cross_size() -> int:
    """Return the number of nodes (ranks sharing this local rank)."""
    return _cross().size


def is_homogeneous() -> bool:
    """Return whether every node runs the same number of ranks."""
    sizes = _world().allgather_object(local_size())
    return len(set(sizes)) == 1


def mpi_threads_supported() -> bool:
    """Return whether MPI runs with thread level "multiple" (commwire's background lanes need it)."""
    return runtime.thread_level() == "multiple"


def mpi_built(verbose: bool = False) -> bool:
    """Return True: commwire always runs over MPI (mpi4py)."""
    return True


def mpi_enabled() -> bool:
    """Return True: collectives run over MPI."""
    return True


def gloo_built(verbose: bool = False) -> bool:
    """Return False: commwire has no Gloo controller."""
    return False


def gloo_enabled() -> bool:
    """Return False: commwire has no Gloo controller."""
    return False


def nccl_built(verbose: bool = False) -> int:
    """Return torch's NCCL version (as Horovod: e.g. 22703) when CUDA tensors travel over NCCL, else 0.

    They do when the world's data transport is torch.distributed with an NCCL backend for CUDA
    (``COMMWIRE_TRANSPORT=torch`` where CUDA exists); over MPI they go to a CUDA-aware MPI or are staged.
    """
    if not runtime.is_initialized():
        return 0
    backends = getattr(runtime.world().transport, "backends", {})
    if backends.get("cuda") != "nccl":
        return 0
    import torch

    version = torch.cuda.nccl.version()
    major, minor, patch = version if isinstance(version, tuple) else (version // 1000, version // 100 % 10,
                                                                       version % 100)
    return int(major * 10000 + minor * 100 + patch)


def ddl_built(verbose: bool = False) -> bool:
    """Return False: no IBM DDL."""
    return False


def ccl_built(verbose: bool = False) -> bool:
    """Return False: no oneCCL."""
    return False


def cuda_built(verbose: bool = False) -> bool:
    """Return whether CUDA tensors can be communicated (torch with CUDA: direct or host-staged)."""
    import torch

    return bool(torch.cuda.is_available())


def rocm_built(verbose: bool = False) -> bool:
    """Return False: ROCm is not supported."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a Chrome-trace timeline to ``file_path`` (on every rank; rank 0 writes it)."""
    if mark_cycles:
        warnings.warn("start_timeline(mark_cycles=True): commwire has no negotiation cycles to mark; the "
                      "timeline records each collective and its phases", stacklevel=2)
    runtime.start_timeline(file_path)


def stop_timeline() -> None:
    """Stop the timeline and write it (collective: every rank calls it)."""
    runtime.stop_timeline()
