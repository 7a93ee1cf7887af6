"""Read commwire's environment-variable fallbacks in one place.

Explicit keyword arguments always win; these variables are only consulted when
an argument is left as ``None``. Every variable is named ``COMMWIRE_*`` and an
unknown or malformed value raises ``ValueError`` naming the variable.

| variable | type | meaning |
|---|---|---|
| COMMWIRE_CHECK | 1/first/0 | verify ranks agree on shapes/dtypes/ops: before every collective (1), on the first call of each (operation, name) (first, the default), never (0) |
| COMMWIRE_TIMELINE | path | write a Chrome-trace timeline of every operation to this file (rank 0's path counts; written as recorded, the other ranks' events in PATH.rank<r> until finalize merges them) |
| COMMWIRE_THREAD_LEVEL | single/funneled/serialized/multiple | MPI thread level requested at init |
| COMMWIRE_CUDA_AWARE | auto/0/1 | pass device pointers straight to MPI (auto = detect) |
| COMMWIRE_RUN | bool | set by ``commwire run``: install the abort-on-exception hook at import |
| COMMWIRE_RUN_DIR | path | set by ``commwire run``: where ranks leave their status files |
| COMMWIRE_ABORT_ON_ERROR | bool | abort the whole job when any rank raises (default on) |
| COMMWIRE_LAB_DIR | path | state directory of the emulated cluster (default /run/commwire-lab) |
| COMMWIRE_TIMEOUT | seconds | stall watchdog: report a collective waiting this long (default 300, 0 = off) |
| COMMWIRE_ON_STALL | abort/warn | what the watchdog does after its report (default abort) |
| COMMWIRE_CODEC_THREADS | int | CPU threads per rank for codec kernels (default, or 0: cores / ranks on the node) |
| COMMWIRE_HIERARCHICAL | 0/node/int | compressed all-reduces: lossless inside each node (or group of that many consecutive ranks), the codec only across nodes (default 0: flat) |
| COMMWIRE_TRANSPORT | mpi/torch | what carries the world's data: MPI (default) or torch.distributed (gloo, NCCL) |
| COMMWIRE_ELASTIC | ulfm/relaunch | set by ``commwire run``'s elastic options: how a lost peer is re-formed |
| COMMWIRE_ELASTIC_DIR | path | set by ``commwire run`` (elastic): host notices and each host's kept commit |
| COMMWIRE_ELASTIC_VERSION | int | set by ``commwire run`` (elastic): the host-update version the job started at |
| COMMWIRE_HOST | name | the host name elastic jobs use for this process (default: network namespace, hostname) |

The Horovod adapter (``commwire.torch``) also honours the Horovod variables in
:data:`HOROVOD_VARIABLES` (read with the same helpers, at ``hvd.init()``), so a
Horovod job keeps its settings; ``commwire.torch`` reports the others it finds.
The launcher's rank variables are not settings: ``commwire.comm.rankenv`` reads them.
"""

from __future__ import annotations

import os

__all__ = ["env_bool", "env_str", "env_choice", "env_float", "env_int", "env_number", "set_variables",
           "cuda_aware_setting",
           "VARIABLES", "HOROVOD_VARIABLES"]

VARIABLES = (
    "COMMWIRE_CHECK",
    "COMMWIRE_TIMELINE",
    "COMMWIRE_THREAD_LEVEL",
    "COMMWIRE_CUDA_AWARE",
    "COMMWIRE_RUN",
    "COMMWIRE_RUN_DIR",
    "COMMWIRE_ABORT_ON_ERROR",
    "COMMWIRE_LAB_DIR",
    "COMMWIRE_TIMEOUT",
    "COMMWIRE_ON_STALL",
    "COMMWIRE_CODEC_THREADS",
    "COMMWIRE_TRANSPORT",
    "COMMWIRE_HIERARCHICAL",
    "COMMWIRE_ELASTIC",
    "COMMWIRE_ELASTIC_DIR",
    "COMMWIRE_ELASTIC_VERSION",
    "COMMWIRE_HOST",
)

HOROVOD_VARIABLES = {
    "HOROVOD_FUSION_THRESHOLD": "bytes per fusion bucket of DistributedOptimizer (0: one all-reduce per tensor)",
    "HOROVOD_TIMELINE": "Chrome-trace timeline path; 'DYNAMIC': none until hvd.start_timeline()",
    "HOROVOD_DYNAMIC_PROCESS_SETS": "accepted: process sets may always be added after init",
    "HOROVOD_STALL_CHECK_DISABLE": "1 turns commwire's stall watchdog off",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "seconds before the stall watchdog reports (on_stall='warn')",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "seconds before the stall watchdog aborts the job",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "1: compressed all-reduces reduce losslessly inside each node and run the codec "
                                      "across nodes (COMMWIRE_HIERARCHICAL); uncompressed ones: MPI picks the "
                                      "algorithm",
}
"""Horovod's variables that ``commwire.torch`` honours (name -> what it does there); COMMWIRE_* ones win."""

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _known(name: str) -> None:
    if name not in VARIABLES and name not in HOROVOD_VARIABLES:
        raise KeyError(f"{name} is not a documented commwire variable; known: {', '.join(VARIABLES)}, and "
                       f"the Horovod ones {', '.join(HOROVOD_VARIABLES)}")


def env_str(name: str, default: str | None = None) -> str | None:
    """Return the raw value of a documented COMMWIRE_* (or honoured HOROVOD_*) variable, or ``default``."""
    _known(name)
    return os.environ.get(name, default)


def set_variables(prefix: str = "COMMWIRE_") -> dict[str, str]:
    """Return every variable set in the environment whose name starts with ``prefix``, known or not (sorted)."""
    return {name: os.environ[name] for name in sorted(os.environ) if name.startswith(prefix)}


def env_bool(name: str, default: bool = False) -> bool:
    """Parse a boolean COMMWIRE_* variable (1/0, true/false, yes/no, on/off)."""
    raw = env_str(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use 1 or 0")


def env_float(name: str, default: float) -> float:
    """Parse a numeric COMMWIRE_* variable."""
    raw = env_str(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; use e.g. {default:g}") from None


def env_int(name: str, default: int, *, minimum: int = 0) -> int:
    """Parse a whole-number COMMWIRE_* variable of at least ``minimum`` (``"4"`` and ``"4.0"`` alike)."""
    raw = env_str(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; use a whole number such as 4") from None
    if not value.is_integer() or value < minimum:
        raise ValueError(f"{name}={raw!r} must be a whole number >= {minimum}")
    return int(value)


def env_number(name: str, kind: type = float) -> float | int | None:
    """Parse a non-negative numeric variable as ``kind`` (int or float); None when unset or empty."""
    raw = env_str(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; set it to e.g. {'67108864' if kind is int else '60'} "
                         "or unset it") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0")
    return value


def cuda_aware_setting() -> str:
    """Return COMMWIRE_CUDA_AWARE: ``"auto"`` (the default: ask the MPI library), ``"0"`` or ``"1"``."""
    return env_choice("COMMWIRE_CUDA_AWARE", ("auto", "0", "1"), "auto")


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Parse a COMMWIRE_* variable that must be one of ``choices``."""
    raw = env_str(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={raw!r} is not valid; use one of {', '.join(choices)}")
    return value
