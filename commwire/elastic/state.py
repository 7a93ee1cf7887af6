"""``State`` and ``ObjectState``: what an elastic run commits, restores and syncs.

Semantics follow Horovod Elastic (``horovod.common.elastic``): ``save``/``restore``
are local and cheap; ``sync`` is collective. Two additions make them work past a
relaunch and under a fault-tolerant MPI:

* every commit has an id (how many commits came before it, counted alike on
  every rank); ``sync`` broadcasts from the rank holding the newest commit
  (rank 0 when all hold the same), not always from rank 0;
* under an elastic launch each commit is also written to the
  host's memory (commwire.elastic.spool), and the first ``sync`` of a relaunched
  job starts from the newest commit any host holds.

Outside an elastic launch nothing here talks to a driver and ``sync`` is
Horovod's broadcast from rank 0.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from . import runner, spool
from .errors import HostsUpdatedInterrupt

__all__ = ["State", "ObjectState"]


def _world() -> Any:
    from ..comm import runtime

    return runtime.world()


def _default_bcast(obj: Any, root_rank: int = 0) -> Any:
    return _world().broadcast_object(obj, root_rank, name="commwire.elastic.state")


def _default_rank() -> int:
    return _world().rank


class State:
    """State tracked across workers: commit (in memory), restore, sync, host updates, reset callbacks.

    Args:
        bcast_object: broadcasts a picklable object from a root rank (``f(obj)`` or
            ``f(obj, root_rank=r)``); default: over commwire's world.
        get_rank: returns this worker's rank; default: commwire's world rank.

    Subclasses implement ``save``, ``restore`` and ``sync`` (and, to survive a relaunch,
    ``_snapshot``/``_load_snapshot``).
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or _default_bcast
        self._rank = get_rank or _default_rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._last_updated_timestamp = runner.launch_version()
        self._commit_id = 0
        self._spool_checked = False
        self._spool_writer = False

    # ------------------------------------------------------------------ Horovod's API
    def register_reset_callbacks(self, callbacks: Sequence[Callable[[], Any]]) -> None:
        """Register functions called after every reset (a worker lost or added), e.g. to rescale the LR."""
        callbacks = list(callbacks)
        bad = [c for c in callbacks if not callable(c)]
        if bad:
            raise TypeError(f"reset callbacks must be callable; got {bad!r}: pass functions, e.g. "
                            "state.register_reset_callbacks([on_reset])")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run ``reset()`` and the reset callbacks (``run`` calls this after re-forming the world)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory (under an elastic launch also in the host's memory), then check for host updates.

        Raises:
            HostsUpdatedInterrupt: the launcher added or removed hosts (on every rank together).
            RuntimeError: called outside ``run`` under an elastic launch (nothing could catch the interrupt).
        """
        runner.check_inside_run("commit()")
        self._save_commit()
        self.check_host_updates()

    def _save_commit(self) -> None:
        """Save, count the commit, and keep it in the host's memory under an elastic launch."""
        self.save()
        self._commit_id += 1
        if runner.mode() is not None:
            self._spool()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank if the launcher reported a change of hosts.

        Rank 0 reads the driver's notice; one broadcast tells the others, so every rank raises
        at the same call. Outside an elastic launch this is a no-op (no driver to hear from).
        """
        if runner.mode() is None:
            return
        previous = self._last_updated_timestamp
        latest, removed_only = runner.read_notice() if self._rank() == 0 else (previous, False)
        previous, latest, removed_only = self._broadcast((previous, latest, removed_only), 0)
        self._last_updated_timestamp = latest
        if latest > previous:
            raise HostsUpdatedInterrupt(bool(removed_only))

    def save(self) -> None:
        """Save the state in host memory (local, no communication)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last commit, undoing uncommitted changes (local)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every worker's state equal to the newest commit's holder (collective)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Rebuild what depends on the world (before the reset callbacks); nothing by default."""

    # ------------------------------------------------------------------ commwire's additions
    @property
    def commit_id(self) -> int:
        """How many commits the state has had (the same on every rank after a sync)."""
        return self._commit_id

    def _snapshot(self) -> Any:
        """Return a picklable copy of the committed state (kept in the host's memory for a relaunch)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be kept for a relaunch: implement _snapshot "
                                  "and _load_snapshot, or derive from ObjectState")

    def _load_snapshot(self, snapshot: Any) -> None:
        """Make ``snapshot`` (from ``_snapshot``) the committed state and restore it."""
        raise NotImplementedError

    def _broadcast(self, obj: Any, root: int) -> Any:
        return self._bcast_object(obj) if root == 0 else self._bcast_object(obj, root_rank=root)

    def _spool(self) -> None:
        if self._spool_writer:
            spool.write(self._commit_id, self._snapshot())

    def _choose_root(self) -> int:
        """Return the rank that holds the newest commit (collective under an elastic launch; else 0).

        On the first sync of a process, a host's kept commit (from before a relaunch) counts;
        the chosen rank loads it before the broadcast.
        """
        if runner.mode() is None:
            return 0
        world = _world()
        kept = None
        if not self._spool_checked:
            self._spool_checked = True
            kept = spool.newest()
        candidate = max(self._commit_id, kept[0] if kept else -1)
        entries = world.allgather_object((candidate, spool.host_id()), name="commwire.elastic.root")
        newest = max(c for c, _ in entries)
        root = min(r for r, (c, _) in enumerate(entries) if c == newest)
        hosts = [h for _, h in entries]
        self._spool_writer = hosts.index(hosts[world.rank]) == world.rank  # the lowest rank of each host
        if world.rank == root and kept is not None and kept[0] > self._commit_id:
            self._load_snapshot(kept[1])
        self._commit_id = newest
        return root


class ObjectState(State):
    """State of plain Python objects, each given as a keyword argument and exposed as an attribute.

    Args:
        bcast_object: as for ``State``.
        get_rank: as for ``State``.
        **kwargs: the attributes to track (e.g. ``epoch=0, batch=0``).

    ``save`` keeps references to the attributes' current values (as Horovod's does):
    rebind attributes (``state.epoch += 1``) rather than mutating a kept object in place.
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        self._sync_objects(self._choose_root())

    def _sync_objects(self, root: int) -> None:
        if self._saved_state:
            self._saved_state = self._broadcast(self._saved_state, root)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def _snapshot(self) -> Any:
        return {"objects": dict(self._saved_state)}

    def _load_snapshot(self, snapshot: Any) -> None:
        self._saved_state = dict(snapshot["objects"])
        self.restore()
