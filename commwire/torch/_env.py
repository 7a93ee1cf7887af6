"""Horovod's environment variables: honoured where commwire has the feature, reported where not.

Read once at ``hvd.init()``. A variable commwire honours changes its
behaviour (the table below says how); one that has no counterpart triggers a
single warning naming it and why, so a setting is never silently dropped; a
bad value is an error naming the variable.
"""

from __future__ import annotations

import warnings
from typing import Any

from .. import _config

__all__ = ["HONOURED", "NO_EFFECT", "init_kwargs", "apply_at_init", "fusion_threshold_bytes"]

HONOURED = _config.HOROVOD_VARIABLES
NO_EFFECT = {
    "HOROVOD_CYCLE_TIME": "commwire starts each collective when it is called; there is no negotiation cycle",
    "HOROVOD_TIMELINE_MARK_CYCLES": "there are no negotiation cycles to mark",
    "HOROVOD_CACHE_CAPACITY": "commwire remembers 4096 agreed signatures per communicator",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "MPI picks the all-gather algorithm",
    "HOROVOD_TORUS_ALLREDUCE": "no NCCL torus all-reduce",
    "HOROVOD_AUTOTUNE": "commwire tunes the compressed all-reduce's segments itself",
    "HOROVOD_AUTOTUNE_LOG": "no Horovod autotuner",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "no Horovod autotuner",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "no Horovod autotuner",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "no Horovod autotuner",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "no Horovod autotuner",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "no Gloo controller (the torch transport's gloo groups use torch's timeout)",
    "HOROVOD_NUM_NCCL_STREAMS": "commwire does not use NCCL",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "no device-to-device batching",
    "HOROVOD_GROUPED_ALLREDUCES": "grouped collectives always fuse",
    "HOROVOD_DISABLE_GROUP_FUSION": "grouped collectives always fuse",
    "HOROVOD_THREAD_AFFINITY": "commwire starts no pinned background thread",
    "HOROVOD_GPU_OPERATIONS": "CUDA buffers travel over NCCL with COMMWIRE_TRANSPORT=torch, else to a CUDA-aware "
                              "MPI or staged through host memory",
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
# Switches whose "off" (0) is what commwire does anyway: set to 0 they are no setting lost.
_OFF_IS_COMMWIRES = {"HOROVOD_TIMELINE_MARK_CYCLES", "HOROVOD_HIERARCHICAL_ALLGATHER",
                     "HOROVOD_TORUS_ALLREDUCE", "HOROVOD_AUTOTUNE", "HOROVOD_MPI_THREADS_DISABLE",
                     "HOROVOD_LOG_HIDE_TIME", "HOROVOD_BATCH_D2D_MEMCOPIES", "HOROVOD_ENABLE_XLA_OPS"}
_LAUNCHER = ("HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
             "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
             "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_IFACE", "HOROVOD_ELASTIC")


def fusion_threshold_bytes() -> int | None:
    """Return HOROVOD_FUSION_THRESHOLD in bytes, or None when unset."""
    return _config.env_number("HOROVOD_FUSION_THRESHOLD", int)


def init_kwargs() -> dict[str, Any]:
    """Return ``commwire.init`` arguments implied by Horovod's variables (commwire's own win if set)."""
    kwargs: dict[str, Any] = {}
    timeline = _config.env_str("HOROVOD_TIMELINE")
    if timeline and timeline.upper() != "DYNAMIC" and _config.env_str("COMMWIRE_TIMELINE") is None:
        kwargs["timeline"] = timeline
    if _config.env_str("COMMWIRE_TIMEOUT") is None:
        if (_config.env_str("HOROVOD_STALL_CHECK_DISABLE") or "0").strip() not in ("", "0"):
            kwargs["timeout"] = 0.0
        elif (shutdown := _config.env_number("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")) is not None and shutdown > 0:
            kwargs["timeout"], kwargs["on_stall"] = shutdown, "abort"
        elif (check := _config.env_number("HOROVOD_STALL_CHECK_TIME_SECONDS")) is not None and check > 0:
            kwargs["timeout"], kwargs["on_stall"] = check, "warn"
    return kwargs


def apply_at_init() -> None:
    """Validate and apply the honoured variables; warn once about those without effect."""
    fusion_threshold_bytes()
    if _config.env_str("COMMWIRE_HIERARCHICAL") is None:
        from ..codecs.hierarchical import set_default_hierarchy

        set_default_hierarchy(_config.env_bool("HOROVOD_HIERARCHICAL_ALLREDUCE") or None)
    ignored = []
    for name, value in _config.set_variables("HOROVOD_").items():
        if name in HONOURED or name in _LAUNCHER:
            continue
        if name in NO_EFFECT:
            if name in _OFF_IS_COMMWIRES and value.strip() in ("", "0"):
                continue
            ignored.append(f"{name}={value!r}: {NO_EFFECT[name]}")
        else:
            ignored.append(f"{name}={value!r}: not a Horovod variable commwire knows (typo?)")
    if ignored:
        warnings.warn("these Horovod settings have no effect in commwire (unset them to silence this):\n  "
                      + "\n  ".join(ignored), stacklevel=3)
