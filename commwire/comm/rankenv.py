"""Read the ranks the MPI launcher announced in the environment: the one reader of its variables.

Before MPI starts, and where it cannot be asked (a crash report, per-rank status
files, the codec thread count chosen before ``init()``), a rank learns where it
stands from the variables its launcher set. Each launcher names them its own way;
:data:`LAUNCHER_VARIABLES` lists them all, and every value is read from the first
variable in its list that holds a number.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["LAUNCHER_VARIABLES", "LauncherRanks", "launcher_ranks", "host_id"]

LAUNCHER_VARIABLES: dict[str, tuple[str, ...]] = {
    # MPICH/Intel MPI (Hydra, PMI), Open MPI, Slurm (srun), PMIx (Open MPI 5, srun --mpi=pmix)
    "rank": ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMIX_RANK"),
    "size": ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"),
    "local_rank": ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"),
    "local_size": ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"),
}
"""For each value, the launchers' variables that carry it, in the order they are tried."""


class LauncherRanks(NamedTuple):
    """Where this process stands in the job, as the launcher announced it (None: not announced)."""

    rank: int | None
    size: int | None
    local_rank: int | None
    local_size: int | None


def _first_number(names: tuple[str, ...], environ: Mapping[str, str], least: int) -> int | None:
    for name in names:
        # Slurm writes "4(x2)" for several nodes with the same count: the leading number is this node's.
        digits = environ.get(name, "").split("(")[0].strip()
        if digits.isdigit() and int(digits) >= least:
            return int(digits)
    return None


def launcher_ranks(environ: Mapping[str, str] | None = None) -> LauncherRanks:
    """Return this process's rank, size, local rank and local size from the launcher's variables.

    Args:
        environ: the environment to read (default ``os.environ``).

    Example:
        >>> launcher_ranks({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8"})
        LauncherRanks(rank=3, size=8, local_rank=None, local_size=None)
    """
    env = os.environ if environ is None else environ
    return LauncherRanks(
        rank=_first_number(LAUNCHER_VARIABLES["rank"], env, 0),
        size=_first_number(LAUNCHER_VARIABLES["size"], env, 1),
        local_rank=_first_number(LAUNCHER_VARIABLES["local_rank"], env, 0),
        local_size=_first_number(LAUNCHER_VARIABLES["local_size"], env, 1),
    )


def host_id() -> str:
    """Return the name of the host this process runs on.

    COMMWIRE_HOST if set; else the network namespace the process runs in, when it
    is a named one (the emulated lab's hosts share one machine and one hostname);
    else the hostname.
    """
    import socket

    named = os.environ.get("COMMWIRE_HOST")
    if named:
        return named
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        for name in sorted(os.listdir("/run/netns")):
            if os.stat(os.path.join("/run/netns", name)).st_ino == mine:
                return name
    except OSError:
        pass
    return socket.gethostname()
