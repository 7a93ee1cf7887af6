"""horovodrun's options in ``commwire run``, with their meaning where commwire has one.

A horovodrun launch line runs unchanged under ``commwire run``:

- the tuning, timeline, stall-check, library and logging options set the
  HOROVOD_* variables horovodrun sets, with its conversions; each rank's
  ``hvd.init()`` honours the ones commwire has a counterpart for (the stall
  check becomes commwire's watchdog) and names the others in one warning
  (commwire.torch._env);
- ``--network-interface(s)`` and ``-p``/``-i`` (ssh) become the launcher's own
  flags (MPICH/Intel MPI Hydra, Open MPI) and torch.distributed's interface
  variables;
- ``--mpi`` is commwire's way anyway; ``--gloo`` moves the data over gloo
  (COMMWIRE_TRANSPORT=torch; MPI still starts the ranks and carries control);
  ``--tcp`` disables InfiniBand in NCCL, as horovodrun does;
- ``--prefix-output-with-timestamp`` stamps each output line as horovodrun does;
  ``--disable-cache`` has nothing to disable;
- ``--jsrun`` and ``--config-file`` are refused with what to do instead.
"""

from __future__ import annotations

from typing import Any, Callable

import click

__all__ = ["KNOBS", "options", "environment", "interfaces", "launcher_args", "refused"]

# (option declarations, parameter, variable, click type or "flag", help): horovodrun's knobs
KNOBS: list[tuple[tuple[str, ...], str, str, Any, str]] = [
    (("--cache-capacity",), "cache_capacity", "HOROVOD_CACHE_CAPACITY", click.IntRange(min=0),
     "response cache size (no effect: commwire keeps 4096 agreed signatures)"),
    (("--hierarchical-allreduce/--no-hierarchical-allreduce",), "hierarchical_allreduce",
     "HOROVOD_HIERARCHICAL_ALLREDUCE", "flag",
     "compressed all-reduces: lossless inside each node, the codec across nodes (uncompressed: MPI picks)"),
    (("--hierarchical-allgather/--no-hierarchical-allgather",), "hierarchical_allgather",
     "HOROVOD_HIERARCHICAL_ALLGATHER", "flag", "no effect: MPI picks the algorithm"),
    (("--torus-allreduce/--no-torus-allreduce",), "torus_allreduce", "HOROVOD_TORUS_ALLREDUCE", "flag",
     "no effect: no NCCL torus all-reduce"),
    (("--autotune/--no-autotune",), "autotune", "HOROVOD_AUTOTUNE", "flag",
     "no effect: commwire tunes the compressed all-reduce's segments itself"),
    (("--autotune-log-file",), "autotune_log_file", "HOROVOD_AUTOTUNE_LOG", str, "no effect (no autotuner)"),
    (("--autotune-warmup-samples",), "autotune_warmup_samples", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", int,
     "no effect (no autotuner)"),
    (("--autotune-steps-per-sample",), "autotune_steps_per_sample", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", int,
     "no effect (no autotuner)"),
    (("--autotune-bayes-opt-max-samples",), "autotune_bayes_opt_max_samples",
     "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", int, "no effect (no autotuner)"),
    (("--autotune-gaussian-process-noise",), "autotune_gaussian_process_noise",
     "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", float, "no effect (no autotuner)"),
    (("--timeline-mark-cycles/--no-timeline-mark-cycles",), "timeline_mark_cycles", "HOROVOD_TIMELINE_MARK_CYCLES",
     "flag", "no effect: no negotiation cycles to mark"),
    (("--no-stall-check/--stall-check",), "no_stall_check", "HOROVOD_STALL_CHECK_DISABLE", "flag",
     "turn commwire's stall watchdog off"),
    (("--stall-check-warning-time-seconds",), "stall_check_warning_time_seconds",
     "HOROVOD_STALL_CHECK_TIME_SECONDS", click.IntRange(min=0), "watchdog: report a stall after this long"),
    (("--stall-check-shutdown-time-seconds",), "stall_check_shutdown_time_seconds",
     "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", click.IntRange(min=0), "watchdog: end the job after a stall this long"),
    (("--mpi-threads-disable/--no-mpi-threads-disable",), "mpi_threads_disable", "HOROVOD_MPI_THREADS_DISABLE",
     "flag", "no effect: commwire's lanes need MPI thread level 'multiple'"),
    (("--num-nccl-streams",), "num_nccl_streams", "HOROVOD_NUM_NCCL_STREAMS", int, "no effect"),
    (("--thread-affinity",), "thread_affinity", "HOROVOD_THREAD_AFFINITY", str, "no effect: no pinned thread"),
    (("--gloo-timeout-seconds",), "gloo_timeout_seconds", "HOROVOD_GLOO_TIMEOUT_SECONDS", int,
     "no effect: no Gloo controller"),
    (("--log-level",), "log_level", "HOROVOD_LOG_LEVEL",
     click.Choice(["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"], case_sensitive=False),
     "no effect: commwire reports errors as exceptions"),
    (("--log-without-timestamp/--log-with-timestamp", "--log-hide-timestamp/--no-log-hide-timestamp"),
     "log_without_timestamp", "HOROVOD_LOG_HIDE_TIME", "flag", "no effect"),
]

_OTHERS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--network-interfaces", "--network-interface", "nics"),
     {"multiple": True, "metavar": "NIC[,NIC]", "help": "network interfaces for MPI and torch.distributed"}),
    (("-p", "--ssh-port", "ssh_port"), {"type": click.IntRange(1, 65535), "help": "ssh port on every host"}),
    (("-i", "--ssh-identity-file", "ssh_identity_file"), {"type": click.Path(dir_okay=False),
                                                          "help": "ssh private key file"}),
    (("--gloo", "use_gloo"), {"is_flag": True, "help": "move the data over gloo (COMMWIRE_TRANSPORT=torch)"}),
    (("--mpi", "use_mpi"), {"is_flag": True, "help": "use MPI (commwire's way anyway)"}),
    (("--jsrun", "use_jsrun"), {"is_flag": True, "help": "refused: launch with jsrun yourself"}),
    (("--tcp", "tcp_flag"), {"is_flag": True, "help": "TCP only: NCCL_IB_DISABLE=1"}),
    (("--binding-args",), {"metavar": "ARGS", "help": "process binding flags, appended to the launcher's"}),
    (("-prefix-timestamp", "--prefix-output-with-timestamp", "prefix_timestamp"),
     {"is_flag": True, "help": "stamp each output line with the time, as horovodrun does"}),
    (("--disable-cache",), {"is_flag": True, "help": "no effect: nothing is cached"}),
    (("--config-file",), {"type": click.Path(dir_okay=False), "help": "refused: pass the options themselves"}),
]

def options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add horovodrun's options (grouped at the end of ``commwire run --help``) to a click command."""
    for decls, kwargs in reversed(_OTHERS):
        func = click.option(*decls, **kwargs)(func)
    for decls, param, variable, kind, text in reversed(KNOBS):
        help_text = f"horovodrun's: sets {variable}; {text}"
        if kind == "flag":
            func = click.option(*decls, param, default=None, help=help_text)(func)
        else:
            func = click.option(*decls, param, type=kind, default=None, help=help_text)(func)
    return func


def refused(values: dict[str, Any]) -> str | None:
    """Return why the horovodrun options in ``values`` cannot run as asked (None if they can)."""
    if values.get("use_jsrun"):
        return ("--jsrun: commwire run has no jsrun launcher; start the job with jsrun itself "
                "(jsrun -n N python train.py): commwire's init works under any MPI launcher")
    if values.get("config_file"):
        return ("--config-file: commwire run reads no horovodrun YAML config; pass its settings as options "
                "(e.g. --fusion-threshold-mb 64 --no-stall-check)")
    if values.get("use_gloo") and values.get("use_mpi"):
        return "--gloo and --mpi: choose one"
    return None


def environment(values: dict[str, Any]) -> dict[str, str]:
    """Return the variables horovodrun sets for the options in ``values`` (those given)."""
    env: dict[str, str] = {}
    for _, param, variable, kind, _ in KNOBS:
        value = values.get(param)
        if value is None:
            continue
        env[variable] = str(int(value)) if kind == "flag" else str(value)
    if values.get("use_gloo"):
        env["COMMWIRE_TRANSPORT"] = "torch"
    if values.get("tcp_flag"):
        env["NCCL_IB_DISABLE"] = "1"
    nics = interfaces(values)
    if nics:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    return env


def interfaces(values: dict[str, Any]) -> list[str]:
    """Return the network interfaces given (each option may list several, comma-separated)."""
    return [nic for given in values.get("nics") or () for nic in given.split(",") if nic]


def launcher_prefix(kind: str, values: dict[str, Any]) -> list[str]:
    """Return what goes before launcher ``kind``'s command: MPICH's Hydra takes ssh's -p/-i only from the
    HYDRA_LAUNCHER_EXTRA_ARGS variable (MPICH 5 has no -bootstrap-exec-args)."""
    ssh = _ssh_args(values)
    return ["env", f"HYDRA_LAUNCHER_EXTRA_ARGS={' '.join(ssh)}"] if kind == "mpich" and ssh else []


def _ssh_args(values: dict[str, Any]) -> list[str]:
    return ([f"-p {values['ssh_port']}"] if values.get("ssh_port") else []) + (
        [f"-i {values['ssh_identity_file']}"] if values.get("ssh_identity_file") else [])


def launcher_args(kind: str, values: dict[str, Any]) -> list[str]:
    """Return the flags that tell launcher ``kind`` the interfaces, ssh settings and binding of ``values``."""
    args: list[str] = []
    nics = interfaces(values)
    ssh = _ssh_args(values)
    if kind == "openmpi":
        if nics:
            args += ["--mca", "btl_tcp_if_include", ",".join(nics), "--mca", "oob_tcp_if_include", ",".join(nics)]
        if ssh:
            args += ["--mca", "plm_rsh_args", " ".join(ssh)]
    elif kind in ("mpich", "intel"):
        if len(nics) > 1:
            raise ValueError(f"--network-interface {','.join(nics)}: MPICH's and Intel MPI's Hydra take one "
                             "interface (-iface); give one")
        if nics:
            args += ["-iface", nics[0]]
        if ssh and kind == "intel":
            args += ["-bootstrap", "ssh", "-bootstrap-exec-args", " ".join(ssh)]
        elif ssh:  # MPICH's Hydra has no flag for ssh's arguments: launcher_prefix() sets its variable
            args += ["-launcher", "ssh"]
    elif ssh:  # slurm
        raise ValueError("-p/--ssh-port and -i/--ssh-identity-file: srun starts the ranks without ssh; drop them")
    if values.get("binding_args"):
        import shlex

        args += shlex.split(values["binding_args"])
    return args
