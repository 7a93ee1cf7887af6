"""Horovod's process sets: the registry, registration and lookup.

A registered process set is a commwire Communicator over an MPI
sub-communicator, made with ``check=True``: every collective on it starts with
the descriptor exchange of commwire.comm.check, as Horovod's negotiation does,
so a bad argument raises on every member together and ``join()`` works.

Registration follows Horovod's rules. A set is known by its world ranks, and
the registry (id → ranks) is the same on every rank:

- ``hvd.init(process_sets=[...])`` registers every set of the list; a set given
  as an mpi4py communicator registers every distinct group that communicator
  has across the ranks (both halves of a ``Split``), and each rank's object
  stands for the group it belongs to. Communicator sets get their ids first,
  then the sets given by ranks, in list order (as Horovod numbers them).
- A set whose ranks are registered already binds to that set (so ``init`` may
  be called again with the same sets). An entry that repeats the global set or
  an earlier entry of the same list is invalidated and, once the others are
  registered, reported by a ValueError on the ranks whose list held it (lists
  of communicator sets differ between ranks, so the duplicate may exist on some
  ranks only, as in Horovod).
- ``add_process_set`` refuses ranks that are registered already, on every rank.

Lists that disagree between ranks (counts of communicator sets, new sets given
by ranks, communicators whose members see different groups) raise one
ValueError on every rank, before anything is registered.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from ..comm import runtime
from ..comm.communicator import Communicator

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "comm_of", "registered"]


class ProcessSet:
    """A subset of the ranks that runs collectives together (``process_set=`` of every collective).

    Args:
        ranks_or_comm: the world ranks of the set, or an mpi4py communicator
            (whose members form the set; it may differ between ranks, e.g. a Split).

    Register it with ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set``
    (on every rank, in the same order). Several objects may stand for one
    registered set; removing the set invalidates them all.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.mpi_comm: Any = None
        self.process_set_id: int | None = None
        if hasattr(ranks_or_comm, "Get_rank") and hasattr(ranks_or_comm, "Get_size"):
            self.mpi_comm = ranks_or_comm
            self.ranks: list[int] = []  # known once registered (translated to world ranks)
            return
        try:
            ranks = sorted(operator.index(r) for r in ranks_or_comm)
        except TypeError:
            raise ValueError(f"ProcessSet takes a list of integer ranks or an mpi4py communicator, got "
                             f"{ranks_or_comm!r}") from None
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"a ProcessSet needs distinct ranks, got {list(ranks_or_comm)}")
        self.ranks = ranks

    @property
    def comm(self) -> Communicator | None:
        """The set's communicator on this rank; None if it is not registered or this rank is no member."""
        entry = _entry(self)
        return None if entry is None else entry.comm

    def size(self) -> int | None:
        """Return the number of ranks in the set (None before it is registered)."""
        return None if _entry(self) is None else len(self.ranks)

    def rank(self) -> int | None:
        """Return this process's rank within the set (None before registration or if not a member)."""
        comm = self.comm
        return None if comm is None else comm.rank

    def included(self) -> bool | None:
        """Return whether this process belongs to the set (None while its ranks are unknown)."""
        if not self.ranks:
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


class _Entry:
    """A registered set: its ranks, its communicator here (None on non-members), the objects bound to it."""

    def __init__(self, ranks: list[int], comm: Communicator | None) -> None:
        self.ranks = ranks
        self.comm = comm
        self.bound: list[weakref.ref[ProcessSet]] = []

    def bind(self, ps: ProcessSet, set_id: int) -> None:
        ps.process_set_id, ps.ranks = set_id, list(self.ranks)
        self.bound.append(weakref.ref(ps))

    def invalidate(self) -> None:
        for ref in self.bound:
            ps = ref()
            if ps is not None:
                ps.process_set_id = None
        self.bound.clear()


global_process_set = ProcessSet([0])  # filled in by start(): id 0, every rank
_sets: dict[int, _Entry] = {}
_state: dict[str, Any] = {}
_lock = threading.Lock()


def _entry(ps: ProcessSet) -> _Entry | None:
    entry = _sets.get(ps.process_set_id) if ps.process_set_id is not None else None
    return entry if entry is not None and entry.ranks == ps.ranks else None


def start(world: Communicator, global_comm: Communicator, mpi_comm: Any = None) -> None:
    """Register the global process set (id 0) over ``world``, with ``global_comm`` as its communicator."""
    with _lock:
        _sets.clear()
        _sets[0] = _Entry(list(range(world.size)), global_comm)
        _sets[0].bind(global_process_set, 0)
        global_process_set.mpi_comm = mpi_comm
        _state.update(world=world, next_id=1)


def clear() -> list[Communicator]:
    """Forget every set (no collective); return their communicators (this rank's), for the caller to close."""
    with _lock:
        comms = [e.comm for e in _sets.values() if e.comm is not None]
        for entry in _sets.values():
            entry.invalidate()
        _sets.clear()
        _state.clear()
    return comms


def registered() -> dict[int, list[int]]:
    """Return {process set id: world ranks} of every registered set (the same on every rank)."""
    with _lock:
        return {set_id: list(entry.ranks) for set_id, entry in sorted(_sets.items())}


def _world() -> Communicator:
    if "world" not in _state or not runtime.is_initialized():
        raise ValueError("Horovod has not been initialized; call hvd.init() first")
    return _state["world"]


def register(process_sets: Sequence[ProcessSet] | str | None) -> None:
    """Register ``process_sets`` as ``hvd.init`` does (collective over every rank; see the module's docstring)."""
    if process_sets is None or (isinstance(process_sets, str) and process_sets.lower() == "dynamic"):
        return
    if isinstance(process_sets, (str, ProcessSet)) or not all(isinstance(p, ProcessSet) for p in process_sets):
        raise ValueError(f"process_sets={process_sets!r} is not valid; pass a list of hvd.ProcessSet or 'dynamic'")
    process_sets = list(process_sets)
    with _lock:
        ids = _register(process_sets)
    seen = {0: "the global process set"}
    duplicates = []
    for i, (ps, set_id) in enumerate(zip(process_sets, ids)):
        if set_id in seen:
            ps.process_set_id = None
            what = "a communicator over ranks" if ps.mpi_comm is not None else "ranks"
            duplicates.append(f"entry {i} ({what} {ps.ranks}) repeats {seen[set_id]}")
        else:
            seen[set_id] = f"entry {i}"
    if duplicates:
        raise ValueError(f"process_sets holds duplicates: {'; '.join(duplicates)}. The other sets are registered "
                         "and the duplicates invalidated; pass each set once (call hvd.init(process_sets=[...]) "
                         "again without them, on every rank)")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (on every rank, with the same ranks, in the same order) and return it."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if _entry(ps) is not None:
        raise ValueError(f"{ps} is registered already")
    with _lock:
        _register([ps], adding=True)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregister ``process_set`` (on every rank); return whether it was registered."""
    from ..comm.lane import close_lane

    with _lock:
        entry = _entry(process_set)
        if entry is None or process_set.process_set_id == 0:
            return False
        del _sets[process_set.process_set_id]
        entry.invalidate()
        if entry.comm is not None:
            close_lane(entry.comm)
            entry.comm.free()
    return True


def comm_of(process_set: ProcessSet | None) -> Communicator:
    """Return the communicator of ``process_set`` on this rank; a clear error if it cannot run here."""
    ps = global_process_set if process_set is None else process_set
    if not isinstance(ps, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet (e.g. hvd.global_process_set), got {type(ps).__name__}")
    _world()
    entry = _entry(ps)
    if entry is None:
        raise ValueError(f"{ps} is not registered; register it with hvd.add_process_set() on every rank first")
    if entry.comm is None:
        raise ValueError(f"rank {runtime.rank()} is not a member of {ps}; call collectives of a process set only "
                         "on its members")
    return entry.comm


def _register(requested: list[ProcessSet], adding: bool = False) -> list[int]:
    """Register the sets of ``requested`` (collective over every rank); bind each; return their ids."""
    world = _world()
    mine = ([_world_ranks(ps.mpi_comm, world) for ps in requested if ps.mpi_comm is not None],
            [ps.ranks for ps in requested if ps.mpi_comm is None])
    # Agreed on the global process set's lane, where every Horovod collective runs: a rank still
    # inside another collective meets a mismatch error instead of a hang.
    everyone = _sets[0].comm.call(Communicator.allgather_object, mine, name="add_process_set")
    by_ranks = {tuple(e.ranks): set_id for set_id, e in _sets.items()}
    problem = _disagreement(everyone, world.size, set(by_ranks))
    if problem:  # computed from what every rank received, so every rank raises alike
        raise ValueError(f"process sets must be registered on every rank with the same sets: {problem}")
    groups: list[tuple[int, ...]] = []
    for i in range(len(mine[0])):
        groups += sorted({tuple(comms[i]) for comms, _ in everyone})
    groups += [tuple(ranks) for ranks in mine[1]]
    if adding:
        known = [g for g in groups if g in by_ranks]
        if known:  # the registry is the same on every rank: every rank raises alike
            raise ValueError(f"Attempted to add a duplicate process set: ranks {list(known[0])} are registered "
                             f"already (as process set {by_ranks[known[0]]}); use that set")
    for group in dict.fromkeys(groups):
        if group not in by_ranks:
            by_ranks[group] = _create(world, list(group))
    ids = []
    comm_sets = iter(mine[0])
    for ps in requested:
        set_id = by_ranks[tuple(next(comm_sets) if ps.mpi_comm is not None else ps.ranks)]
        _sets[set_id].bind(ps, set_id)
        ids.append(set_id)
    return ids


def _world_ranks(mpi_comm: Any, world: Communicator) -> list[int]:
    """Return the world ranks of ``mpi_comm``'s members (-1 for a process outside the world), sorted."""
    from mpi4py import MPI

    try:  # a rank that raised here would leave the others in the exchange: it reports "no group" instead
        if mpi_comm == MPI.COMM_NULL:
            return []
        ranks = MPI.Group.Translate_ranks(mpi_comm.Get_group(), list(range(mpi_comm.Get_size())),
                                          world.mpi.Get_group())
    except Exception:  # noqa: BLE001 - whatever MPI says, every rank then raises the same clear error
        return []
    return sorted(-1 if r == MPI.UNDEFINED else int(r) for r in ranks)


def _disagreement(everyone: list[tuple[list[list[int]], list[list[int]]]], size: int,
                  registered: set[tuple[int, ...]]) -> str:
    """Return what the ranks' lists disagree on ('' if nothing), the same text on every rank.

    Sets given by ranks that are ``registered`` already may differ between ranks (each rank
    binds its own objects); the new ones must be the same, in the same order, everywhere.
    """
    counts = [len(comms) for comms, _ in everyone]
    if len(set(counts)) > 1:
        return f"the number of communicator sets differs between ranks {dict(enumerate(counts))}"
    lists = [[r for r in ranks if tuple(r) not in registered] for _, ranks in everyone]
    if any(r != lists[0] for r in lists):
        return (f"the sets given by ranks that are not registered yet differ between ranks "
                f"{dict(enumerate(lists))}")
    bad = sorted({r for ranks in lists[0] for r in ranks if not 0 <= r < size})
    if bad:
        return f"ranks {bad} are not ranks of the world (0..{size - 1})"
    for i in range(counts[0]):
        seen = [comms[i] for comms, _ in everyone]
        for rank, group in enumerate(seen):
            if rank not in group or any(not 0 <= r < size for r in group):
                return (f"the communicator of communicator set {i} on rank {rank} is not a communicator over "
                        f"world ranks that include it (its world ranks: {group}); build it from the world's "
                        "communicator (e.g. MPI.COMM_WORLD.Split)")
            other = next((r for r in group if seen[r] != group), None)
            if other is not None:
                return (f"the members of communicator set {i} see different groups: rank {rank} sees {group}, "
                        f"rank {other} sees {seen[other]}")
    return ""


def _create(world: Communicator, ranks: list[int]) -> int:
    """Make the communicator of a new set over world ranks ``ranks`` (collective over the world); return its id."""
    from mpi4py import MPI

    group = world.mpi.Get_group().Incl(ranks)
    try:
        mpi_sub = world.mpi.Create(group)  # collective over the world; COMM_NULL on non-members
    finally:
        group.Free()
    comm = world.derive(mpi_sub, check=True) if mpi_sub != MPI.COMM_NULL else None
    if comm is not None:
        start_lane(comm)
    set_id = _state["next_id"]
    _state["next_id"] += 1
    _sets[set_id] = _Entry(ranks, comm)
    return set_id


def start_lane(comm: Communicator) -> None:
    """Create ``comm``'s background lane now (collective over its members)."""
    from mpi4py import MPI

    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        from ..comm.lane import lane_for

        lane_for(comm)
