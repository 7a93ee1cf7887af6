"""Read the ranks the MPI launcher announced in the environment: the one reader of its variables.

Before MPI starts, and where it cannot be asked (a crash report, per-rank status
files, the codec thread count chosen before ``init()``), a rank learns where it
stands from the variables its launcher set; ``init()`` compares them with MPI's
world, so that a process started by torchrun or by another MPI's mpiexec, which
MPI starts alone, is told so instead of training alone (``lone_start``). Each
launcher names them its own way; :data:`LAUNCHER_VARIABLES` lists them all, and
every value is read from the first variable in its list that holds a number.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["LAUNCHER_VARIABLES", "SLURM_MPI_PLUGINS", "LauncherRanks", "launcher_ranks", "torch_variables",
           "LoneStart", "lone_start", "host_id", "slurm_mpi_type", "is_this_machine"]

LAUNCHER_VARIABLES: dict[str, tuple[str, ...]] = {
    # MPICH/Intel MPI (Hydra, PMI), Open MPI, Slurm (srun), PMIx (Open MPI 5, srun --mpi=pmix)
    "rank": ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMIX_RANK"),
    "size": ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"),
    "local_rank": ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"),
    "local_size": ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                   "SLURM_STEP_TASKS_PER_NODE"),
}
"""For each value, the launchers' variables that carry it, in the order they are tried."""

SLURM_MPI_PLUGINS = {"MPICH": "pmi2", "Intel MPI": "pmi2", "Open MPI": "pmix"}
"""The ``srun --mpi`` plugin that starts the ranks of each MPI (mpi4py's vendor name) as one job."""


class LauncherRanks(NamedTuple):
    """Where this process stands in the job, as the launcher announced it (None: not announced)."""

    rank: int | None
    size: int | None
    local_rank: int | None
    local_size: int | None


def slurm_mpi_type(environ: Mapping[str, str] | None = None) -> str | None:
    """Return the ``srun --mpi`` plugin chosen through SLURM_MPI_TYPE, or None."""
    env = os.environ if environ is None else environ
    return env.get("SLURM_MPI_TYPE") or None


def _first_number(names: tuple[str, ...], environ: Mapping[str, str], least: int) -> int | None:
    for name in names:
        value = environ.get(name, "")
        number = _on_this_node(value, environ) if name.endswith("TASKS_PER_NODE") else (
            int(value) if value.strip().isdigit() else None)
        if number is not None and number >= least:
            return number
    return None


def _on_this_node(value: str, environ: Mapping[str, str]) -> int | None:
    """This node's count in Slurm's per-node list ("4(x2),3": 4 on the first two nodes, 3 on the third)."""
    counts: list[int] = []
    for part in value.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if found is None:
            return None
        counts += [int(found[1])] * int(found[2] or 1)
    if len(set(counts)) == 1:
        return counts[0]
    # SLURM_NODEID indexes the job's nodes; it indexes the step's list only when the step spans them all.
    node, step_nodes = environ.get("SLURM_NODEID", ""), environ.get("SLURM_STEP_NUM_NODES")
    if node.isdigit() and int(node) < len(counts) and step_nodes == environ.get("SLURM_JOB_NUM_NODES"):
        return counts[int(node)]
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


def torch_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return torchrun's per-process variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) as the MPI
    launcher announced them, leaving out any the environment already sets or the launcher did not announce.

    ``commwire run`` exports them on each rank, so that a script written for torchrun
    (``init_process_group`` with ``env://``, ``int(os.environ["LOCAL_RANK"])``) runs unchanged.

    Example:
        >>> torch_variables({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
        {'RANK': '1', 'WORLD_SIZE': '2', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '2'}
    """
    env = os.environ if environ is None else environ
    ranks = launcher_ranks(env)
    if ranks.rank is None or ranks.size is None:
        return {}
    values = {"RANK": ranks.rank, "WORLD_SIZE": ranks.size, "LOCAL_RANK": ranks.local_rank,
              "LOCAL_WORLD_SIZE": ranks.local_size}
    return {name: str(value) for name, value in values.items() if value is not None and name not in env}


class LoneStart(NamedTuple):
    """A process that MPI started alone although its launcher started it as one of several."""

    launcher: str
    """Who started the others: ``"torchrun"``, ``"torch.distributed"``, ``"srun"`` (with no MPI plugin this
    MPI understands), or ``"mpiexec"`` (another MPI's)."""
    announced: str
    """What says so, e.g. ``"WORLD_SIZE=4"``."""
    size: int
    """How many processes the launcher started."""


# The MPI launchers' size variables that only a launched process sees (Slurm's SLURM_NTASKS is
# also set in a batch script's own, single, process).
_MPI_SIZES = tuple(name for name in LAUNCHER_VARIABLES["size"] if not name.startswith("SLURM_"))


def lone_start(mpi_size: int, environ: Mapping[str, str] | None = None,
               torch_world: int | None = None) -> LoneStart | None:
    """Return who started this process as one of several while MPI gave it a world of ``mpi_size`` = 1.

    Such a process would run every collective alone: torchrun (or any launcher that sets
    torch's ``WORLD_SIZE``) does not start MPI, the mpiexec of one MPI starts processes of
    another MPI as separate 1-process jobs, and so does srun without the MPI plugin
    (``--mpi``) the MPI needs. None when ``mpi_size`` is not 1 or nothing says so.

    Args:
        mpi_size: the size of MPI's world.
        environ: the environment to read (default ``os.environ``).
        torch_world: the world size of an initialised torch.distributed, if any.

    Example:
        >>> lone_start(1, {"WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "none"})
        LoneStart(launcher='torchrun', announced='WORLD_SIZE=4', size=4)
    """
    if mpi_size != 1:
        return None
    env = os.environ if environ is None else environ
    # Only a task srun started is in a step of several tasks (a batch script's process is in none).
    step = _first_number(("SLURM_STEP_NUM_TASKS",), env, 2)
    if step is not None:
        return LoneStart("srun", f"SLURM_STEP_NUM_TASKS={step}", step)
    for name in _MPI_SIZES:
        size = _first_number((name,), env, 2)
        if size is not None:
            return LoneStart("mpiexec", f"{name}={size}", size)
    size = _first_number(("WORLD_SIZE",), env, 2)
    if size is not None:
        return LoneStart("torchrun" if "TORCHELASTIC_RUN_ID" in env else "torch.distributed", f"WORLD_SIZE={size}",
                         size)
    if torch_world is not None and torch_world > 1:
        return LoneStart("torch.distributed", f"torch.distributed.get_world_size() = {torch_world}", torch_world)
    return None


_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}


def is_this_machine(host: str) -> bool:
    """Return whether the host name ``host`` (as given to a launcher) names the machine this process runs on."""
    import socket

    return host in _LOCAL_NAMES | {socket.gethostname(), socket.gethostname().split(".")[0]}


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
