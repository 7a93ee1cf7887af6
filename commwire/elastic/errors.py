"""What interrupts an elastic run: a lost peer, or the launcher's news that hosts changed."""

from __future__ import annotations

__all__ = ["HostsUpdatedInterrupt", "PeerLostError", "is_peer_loss"]


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed (raised on every rank together by ``commit()``/``check_host_updates()``).

    Args:
        skip_sync: True when hosts were only removed (the survivors' state is consistent and
            need not be synchronised again), as Horovod sets it.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts were added or removed; re-forming the world" + (" (removed only)" if skip_sync
                                                                               else ""))
        self.skip_sync = skip_sync


class PeerLostError(RuntimeError):
    """A collective failed because a peer process was lost (the MPI reported a process failure)."""


def _mpi_failure_classes() -> set[int]:
    try:
        from mpi4py import MPI
    except ImportError:  # pragma: no cover - mpi4py is a dependency
        return set()
    return {getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
            if isinstance(getattr(MPI, name, None), int)}


def is_peer_loss(exc: BaseException) -> bool:
    """Return whether ``exc`` (or an exception it was raised from) reports a lost peer.

    True for ``PeerLostError``, Horovod's ``HorovodInternalError``, and an
    ``mpi4py.MPI.Exception`` of class ERR_PROC_FAILED, ERR_PROC_FAILED_PENDING or
    ERR_REVOKED (what a fault-tolerant MPI raises in a collective whose peer died).
    """
    classes = None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PeerLostError) or type(current).__name__ == "HorovodInternalError":
            return True
        if type(current).__module__ == "mpi4py.MPI" and hasattr(current, "Get_error_class"):
            classes = _mpi_failure_classes() if classes is None else classes
            try:
                if current.Get_error_class() in classes:
                    return True
            except Exception:  # noqa: BLE001 - a broken exception object is not a peer loss
                pass
        current = current.__cause__ or current.__context__
    return False
