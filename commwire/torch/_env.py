"""Horovod's environment variables: honoured where commwire has the feature, reported where not.

Read once at ``hvd.init()``. A variable commwire honours changes its
behaviour (the table below says how); one that has no counterpart triggers a
single warning naming it and why, so a setting is never silently dropped; a
bad value is an error naming the variable.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

__all__ = ["HONOURED", "NO_EFFECT", "init_kwargs", "apply_at_init", "fusion_threshold_bytes"]

HONOURED = {
    "HOROVOD_FUSION_THRESHOLD": "bytes per fusion bucket of DistributedOptimizer (0: one all-reduce per tensor)",
    "HOROVOD_TIMELINE": "Chrome-trace timeline path; 'DYNAMIC': none until hvd.start_timeline()",
    "HOROVOD_DYNAMIC_PROCESS_SETS": "accepted: process sets may always be added after init",
    "HOROVOD_STALL_CHECK_DISABLE": "1 turns commwire's stall watchdog off",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "seconds before the stall watchdog reports (on_stall='warn')",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "seconds before the stall watchdog aborts the job",
}
NO_EFFECT = {
    "HOROVOD_CYCLE_TIME": "commwire starts each collective when it is called; there is no negotiation cycle",
    "HOROVOD_TIMELINE_MARK_CYCLES": "there are no negotiation cycles to mark",
    "HOROVOD_CACHE_CAPACITY": "commwire remembers 4096 agreed signatures per communicator",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "MPI picks the all-reduce algorithm",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "MPI picks the all-gather algorithm",
    "HOROVOD_AUTOTUNE": "commwire tunes the compressed all-reduce's segments itself",
    "HOROVOD_AUTOTUNE_LOG": "no Horovod autotuner",
    "HOROVOD_NUM_NCCL_STREAMS": "commwire does not use NCCL",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "no device-to-device batching",
    "HOROVOD_GROUPED_ALLREDUCES": "grouped collectives always fuse",
    "HOROVOD_DISABLE_GROUP_FUSION": "grouped collectives always fuse",
    "HOROVOD_THREAD_AFFINITY": "commwire starts no pinned background thread",
    "HOROVOD_GPU_OPERATIONS": "CUDA buffers go to a CUDA-aware MPI or are staged through host memory",
    "HOROVOD_GPU_ALLREDUCE": "CUDA buffers go to a CUDA-aware MPI or are staged through host memory",
    "HOROVOD_GPU_ALLGATHER": "CUDA buffers go to a CUDA-aware MPI or are staged through host memory",
    "HOROVOD_GPU_BROADCAST": "CUDA buffers go to a CUDA-aware MPI or are staged through host memory",
    "HOROVOD_CPU_OPERATIONS": "CPU collectives always run over MPI",
    "HOROVOD_CONTROLLER": "commwire always runs over MPI",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "commwire's Adasum sends whole vector halves",
    "HOROVOD_ENABLE_XLA_OPS": "no XLA ops",
    "HOROVOD_LOG_LEVEL": "commwire reports errors as exceptions, stalls through its watchdog",
    "HOROVOD_LOG_HIDE_TIME": "commwire reports errors as exceptions, stalls through its watchdog",
    "HOROVOD_MPI_THREADS_DISABLE": "commwire needs MPI thread level 'multiple' for its background lanes",
}
_LAUNCHER = ("HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
             "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
             "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_IFACE", "HOROVOD_ELASTIC")


def _number(name: str, kind: type = float) -> Any:
    raw = os.environ.get(name)
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


def fusion_threshold_bytes() -> int | None:
    """Return HOROVOD_FUSION_THRESHOLD in bytes, or None when unset."""
    return _number("HOROVOD_FUSION_THRESHOLD", int)


def init_kwargs() -> dict[str, Any]:
    """Return ``commwire.init`` arguments implied by Horovod's variables (commwire's own win if set)."""
    kwargs: dict[str, Any] = {}
    timeline = os.environ.get("HOROVOD_TIMELINE")
    if timeline and timeline.upper() != "DYNAMIC" and "COMMWIRE_TIMELINE" not in os.environ:
        kwargs["timeline"] = timeline
    if "COMMWIRE_TIMEOUT" not in os.environ:
        if os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "0").strip() not in ("", "0"):
            kwargs["timeout"] = 0.0
        elif (shutdown := _number("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")) is not None and shutdown > 0:
            kwargs["timeout"], kwargs["on_stall"] = shutdown, "abort"
        elif (check := _number("HOROVOD_STALL_CHECK_TIME_SECONDS")) is not None and check > 0:
            kwargs["timeout"], kwargs["on_stall"] = check, "warn"
    return kwargs


def apply_at_init() -> None:
    """Validate the honoured variables and warn once about those without effect."""
    fusion_threshold_bytes()
    ignored = []
    for name in sorted(k for k in os.environ if k.startswith("HOROVOD_")):
        if name in HONOURED or name in _LAUNCHER:
            continue
        value = os.environ[name]
        if name in NO_EFFECT:
            if name == "HOROVOD_TIMELINE_MARK_CYCLES" and value.strip() in ("", "0"):
                continue
            ignored.append(f"{name}={value!r}: {NO_EFFECT[name]}")
        else:
            ignored.append(f"{name}={value!r}: not a Horovod variable commwire knows (typo?)")
    if ignored:
        warnings.warn("these Horovod settings have no effect in commwire (unset them to silence this):\n  "
                      + "\n  ".join(ignored), stacklevel=3)
