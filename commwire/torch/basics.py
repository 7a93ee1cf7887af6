"""Horovod's lifecycle, introspection and process sets, over commwire's core.

A process set is a commwire Communicator over an MPI sub-communicator, made
with ``check=True``: every collective on it starts with the descriptor
exchange of commwire.comm.check, as Horovod's negotiation does, so a bad
argument raises on every member together and ``join()`` works. The global
process set is such a communicator over the whole world (a duplicate, so its
collectives never interleave with ``commwire``'s own).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any

from ..comm import runtime
from ..comm.communicator import Communicator

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


class ProcessSet:
    """A subset of the ranks that runs collectives together (``process_set=`` of every collective).

    Args:
        ranks_or_comm: the world ranks of the set, or an mpi4py communicator
            (whose members form the set; it may differ between ranks, e.g. a Split).

    Register it with ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set``
    (on every rank, in the same order).
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.mpi_comm: Any = None
        if hasattr(ranks_or_comm, "Get_rank") and hasattr(ranks_or_comm, "Get_size"):
            self.mpi_comm = ranks_or_comm
            self.ranks: list[int] = []  # known once registered (translated to world ranks)
        else:
            try:
                ranks = sorted(int(r) for r in ranks_or_comm)
            except TypeError:
                raise TypeError(f"ProcessSet takes a list of ranks or an mpi4py communicator, got "
                                f"{type(ranks_or_comm).__name__}") from None
            if len(set(ranks)) != len(ranks) or not ranks:
                raise ValueError(f"a ProcessSet needs distinct ranks, got {list(ranks_or_comm)}")
            self.ranks = ranks
        self.process_set_id: int | None = None
        self.comm: Communicator | None = None

    def size(self) -> int | None:
        """Return the number of ranks in the set (None before it is registered)."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """Return this process's rank within the set (None before registration or if not a member)."""
        if self.process_set_id is None or self.comm is None:
            return None
        return self.comm.rank

    def included(self) -> bool | None:
        """Return whether this process belongs to the set (None before it is registered)."""
        if self.process_set_id is None:
            return None
        return runtime.rank() in self.ranks

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        return self.process_set_id == other.process_set_id and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks)))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


global_process_set = ProcessSet([0])  # filled in by init(): id 0, every rank
_sets: dict[int, ProcessSet] = {}
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
        comm: None (MPI_COMM_WORLD), an mpi4py communicator, or a list of
            world ranks to run on (only those ranks may call init).
        process_sets: process sets to register now, or "dynamic" (every
            set may be added later with ``add_process_set``; always allowed).
        **kwargs: passed to ``commwire.init`` (check, timeline, timeout, ...).
    """
    from . import _env

    if comm is not None and not hasattr(comm, "Get_rank"):
        comm = _ranks_comm(list(comm))
    if not runtime.is_initialized():
        runtime.init(comm=comm, **{**_env.init_kwargs(), **kwargs})
    else:
        runtime.init(comm=comm, **kwargs)
    with _lock:
        again = _state.get("world") is runtime.world()
    if again:
        _resync(global_process_set.comm)
        with _lock:
            _register_all(process_sets)
        return
    with _lock:
        world = runtime.world()
        _sets.clear()
        global_process_set.ranks = list(range(world.size))
        global_process_set.process_set_id = 0
        global_process_set.comm = world.duplicate(check=True)
        _sets[0] = global_process_set
        # Everything collective is made now, in the same order on every rank (made lazily, a rank
        # asking for local_rank() while another starts a collective would deadlock).
        _state.update(world=world, next_id=1, cross=world.split(color=world.node().rank, key=world.rank))
        _start_lane(global_process_set.comm)
        _env.apply_at_init()
        _register_all(process_sets)


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


def _register_all(process_sets: Sequence[ProcessSet] | str | None) -> None:
    if process_sets is None or process_sets == "dynamic":
        return
    if isinstance(process_sets, str):
        raise ValueError(f"process_sets={process_sets!r} is not valid; pass a list of ProcessSet or 'dynamic'")
    for ps in process_sets:
        if ps.process_set_id is None:
            _register(ps)


def _world() -> Communicator:
    if "world" not in _state or not runtime.is_initialized():
        raise ValueError("Horovod has not been initialized; call hvd.init() first")
    return _state["world"]


def _register(ps: ProcessSet) -> ProcessSet:
    """Create the communicator of ``ps`` (collective over every rank) and give it the next id."""
    world = _world()
    if ps.mpi_comm is not None:
        from mpi4py import MPI

        members = MPI.Group.Translate_ranks(ps.mpi_comm.Get_group(), list(range(ps.mpi_comm.Get_size())),
                                            world.mpi.Get_group())
        ps.ranks = sorted(int(r) for r in members)
        mpi_sub = ps.mpi_comm.Dup()
    else:
        bad = [r for r in ps.ranks if not 0 <= r < world.size]
        # Agreed on the global process set's lane, where every Horovod collective runs: a rank
        # still inside another collective meets a mismatch error instead of a hang.
        everyone = global_process_set.comm.call(Communicator.allgather_object, ps.ranks, name="add_process_set")
        if bad or any(r != ps.ranks for r in everyone):
            # every rank sees the same list of lists, so every rank raises alike
            raise ValueError(f"add_process_set needs the same valid ranks on every rank (0..{world.size - 1}); "
                             f"got {dict(enumerate(everyone))}")
        if any(other.ranks == ps.ranks and other.mpi_comm is None for other in _sets.values()):
            # the registry is the same on every rank, so every rank raises here alike
            raise ValueError(f"Attempted to add a duplicate process set: ranks {ps.ranks} are registered already")
        group = world.mpi.Get_group().Incl(ps.ranks)
        try:
            mpi_sub = world.mpi.Create(group)  # collective over the world; COMM_NULL on non-members
        finally:
            group.Free()
    ps.comm = world.derive(mpi_sub, check=True) if mpi_sub is not None and mpi_sub != _null() else None
    if ps.comm is not None:
        _start_lane(ps.comm)
    ps.process_set_id = _state["next_id"]
    _state["next_id"] += 1
    _sets[ps.process_set_id] = ps
    return ps


def _start_lane(comm: Communicator) -> None:
    """Create ``comm``'s background lane now (collective over its members)."""
    from mpi4py import MPI

    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        from ..comm.lane import lane_for

        lane_for(comm)


def _null() -> Any:
    from mpi4py import MPI

    return MPI.COMM_NULL


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (on every rank, with the same ranks, in the same order) and return it."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is registered already")
    with _lock:
        return _register(ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregister ``process_set`` (on every rank); return whether it was registered."""
    if process_set.process_set_id in (None, 0) or _sets.get(process_set.process_set_id) is not process_set:
        return False
    from ..comm.lane import close_lane

    with _lock:
        del _sets[process_set.process_set_id]
        if process_set.comm is not None:
            close_lane(process_set.comm)
            process_set.comm.free()
        process_set.process_set_id, process_set.comm = None, None
    return True


def comm_of(process_set: ProcessSet | None) -> Communicator:
    """Return the communicator of ``process_set`` on this rank; a clear error if it cannot run here."""
    ps = global_process_set if process_set is None else process_set
    if not isinstance(ps, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet (e.g. hvd.global_process_set), got {type(ps).__name__}")
    _world()
    if ps.process_set_id is None or _sets.get(ps.process_set_id) is not ps:
        raise ValueError(f"{ps} is not registered; register it with hvd.add_process_set() on every rank first")
    if ps.comm is None:
        raise ValueError(f"rank {runtime.rank()} is not a member of {ps}; call collectives of a process set only "
                         "on its members")
    return ps.comm


def shutdown() -> None:
    """Shut commwire down on this rank (``init()`` may be called again)."""
    from ..comm.lane import close_lane

    with _lock:
        for ps in list(_sets.values()):
            if ps.comm is not None:
                close_lane(ps.comm)
            if ps is not global_process_set:
                ps.process_set_id, ps.comm = None, None
        _sets.clear()
        global_process_set.process_set_id, global_process_set.comm = None, None
        _state.clear()
    runtime.finalize()


def rebuild_after_reform() -> None:
    """Rebuild the global process set on commwire's re-formed world (commwire.elastic, in process).

    The old sets' communicators were revoked by the re-forming: their lanes are
    stopped without any collective, the registry is emptied (sets added with
    ``add_process_set`` must be added again) and ``init()`` builds the global set
    on the survivors.
    """
    from ..comm.lane import close_lane

    with _lock:
        for ps in list(_sets.values()):
            if ps.comm is not None:
                close_lane(ps.comm)
            ps.process_set_id, ps.comm = None, None
        _sets.clear()
        _state.clear()
    init()


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
