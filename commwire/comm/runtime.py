"""Process-wide runtime: MPI initialisation, the world communicator, abort hook.

``init()`` is idempotent. Launched without mpiexec it gives a working 1-rank
world (MPI singleton init). MPI is initialised with thread level "multiple" by
default so that progress threads (the torch adapter's) may call MPI; pass
``thread_level=`` or set COMMWIRE_THREAD_LEVEL to ask for less.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from typing import Any

from .. import _config
from .communicator import Communicator
from .rankenv import SLURM_MPI_PLUGINS, lone_start, slurm_mpi_type
from .transport import TRANSPORTS, MPITransport
from .stats import Counters
from .timeline import Timeline

__all__ = [
    "init",
    "finalize",
    "is_initialized",
    "world",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "new_group",
    "stats",
    "thread_level",
    "transport",
    "cuda_aware",
    "install_abort_hook",
    "report_and_abort",
    "abort_world",
    "default_comm",
    "lone_start_problem",
]

THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")
DEFAULT_TIMEOUT = 300.0
"""Seconds a collective may wait before the stall watchdog reports (COMMWIRE_TIMEOUT)."""

_world: Communicator | None = None
_counters = Counters()
_thread_level: str | None = None
_lock = threading.Lock()
_resets = 0  # how often commwire.elastic re-formed this process's world in place (names the timeline files)


def init(
    *,
    comm: Any = None,
    check: bool | str | None = None,
    timeline: str | None = None,
    thread_level: str | None = None,
    cuda_aware: bool | None = None,
    abort_on_error: bool | None = None,
    timeout: float | None = None,
    on_stall: str | None = None,
    transport: str | None = None,
) -> Communicator:
    """Initialise MPI (once) and return the world communicator.

    Args:
        comm: an mpi4py communicator to use as the world (default COMM_WORLD).
        check: verify that ranks agree on a collective's arguments: True
            before every call, "first" on the first call of each (operation,
            name), False never (fallback: COMMWIRE_CHECK=1/first/0; default
            "first").
        timeline: write a Chrome-trace timeline to this path at finalize
            (fallback: COMMWIRE_TIMELINE).
        thread_level: MPI thread level to request (fallback:
            COMMWIRE_THREAD_LEVEL, default "multiple").
        cuda_aware: hand CUDA buffers to MPI directly; None detects it
            (fallback: COMMWIRE_CUDA_AWARE=auto/0/1).
        abort_on_error: abort the whole job when this rank raises an
            unhandled exception (fallback: COMMWIRE_ABORT_ON_ERROR, default on).
        timeout: seconds a collective may wait for the other ranks before the
            stall watchdog reports which ranks are missing (fallback:
            COMMWIRE_TIMEOUT, default 300; 0 disables the watchdog).
        on_stall: "abort" the job after the report (default) or only "warn"
            (fallback: COMMWIRE_ON_STALL).
        transport: what carries the data: "mpi" (default) or "torch" (torch.distributed: gloo for
            host buffers, NCCL for CUDA buffers where CUDA exists; started here over MPI's ranks
            unless already initialised). MPI stays the control plane either way
            (fallback: COMMWIRE_TRANSPORT).
    """
    global _world, _thread_level
    _validate_init(check, timeline, thread_level, cuda_aware, abort_on_error, timeout, on_stall)
    if transport is not None and transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not valid; use one of {', '.join(map(repr, TRANSPORTS))}")
    with _lock:
        if _world is not None:
            if comm is not None and comm is not _world.mpi:
                raise RuntimeError("commwire is already initialised with another communicator; call finalize() first")
            _check_reinit(_world, timeline=timeline, thread_level=thread_level, cuda_aware=cuda_aware,
                          timeout=timeout, on_stall=on_stall, transport=transport)
            if check is not None:
                _world.check = check
            return _world
        level = thread_level if thread_level is not None else _config.env_choice(
            "COMMWIRE_THREAD_LEVEL", THREAD_LEVELS, "multiple"
        )
        MPI = _import_mpi(level)
        _thread_level = THREAD_LEVELS[MPI.Query_thread()]
        mpi_comm = comm if comm is not None else MPI.COMM_WORLD
        lone = lone_start_problem() if comm is None else None
        if lone is not None:
            why, fix = lone
            raise RuntimeError(f"{why}, so each process would run every collective alone. {fix[0].upper()}{fix[1:]}")
        if check is None:
            level = _config.env_choice("COMMWIRE_CHECK", ("0", "off", "false", "first", "1", "full", "true"), "first")
            check = {"0": False, "off": False, "false": False, "first": "first"}.get(level, True)
        path = timeline if timeline is not None else _config.env_str("COMMWIRE_TIMELINE")
        if cuda_aware is None:
            cuda_aware = _detect_cuda_aware()
        timeout = _config.env_float("COMMWIRE_TIMEOUT", DEFAULT_TIMEOUT) if timeout is None else float(timeout)
        on_stall = on_stall or _config.env_choice("COMMWIRE_ON_STALL", ("abort", "warn"), "abort")
        if timeout < 0:
            raise ValueError(f"COMMWIRE_TIMEOUT={timeout:g} must be >= 0 seconds (0 disables the stall watchdog)")
        watchdog = None
        if timeout > 0 and mpi_comm.Get_size() > 1:
            from .watchdog import Watchdog

            watchdog = Watchdog(mpi_comm, timeout=timeout, action=on_stall)
        transport = transport or _config.env_choice("COMMWIRE_TRANSPORT", TRANSPORTS, "mpi")
        try:
            data = _make_transport(mpi_comm, transport, bool(cuda_aware))
            recorder = open_timeline(mpi_comm, timeline_path(path, _config.env_int("COMMWIRE_ELASTIC_VERSION", 0),
                                                             _resets) if path else None)
        except BaseException:
            if watchdog is not None:
                watchdog.close()
            raise
        _world = Communicator(mpi_comm, transport=data, counters=_counters, check=check, timeline=recorder,
                              cuda_aware=cuda_aware, watchdog=watchdog)
        # Derived communicators are made collectively: made later, on first use, ranks that
        # first ask in different places (one calls local_rank(), another a collective) deadlock.
        _world.node()
        _settings.update(timeline=path or None, thread_level=level, cuda_aware=bool(cuda_aware), timeout=timeout,
                         on_stall=on_stall, transport=transport)
        if _config.env_bool("COMMWIRE_ABORT_ON_ERROR", True) if abort_on_error is None else abort_on_error:
            install_abort_hook()
        atexit.register(_finalize_at_exit)
        return _world


def lone_start_problem() -> tuple[str, str] | None:
    """Return (what is wrong, the fix) when MPI made this process a world of 1 although its launcher
    started it as one of several (torchrun; another MPI's mpiexec), else None. Initialises MPI."""
    from mpi4py import MPI

    dist = sys.modules.get("torch.distributed")  # never imported here: without it nothing started torch's world
    torch_world = dist.get_world_size() if dist is not None and dist.is_available() and dist.is_initialized() else None
    lone = lone_start(MPI.COMM_WORLD.Get_size(), torch_world=torch_world)
    if lone is None:
        return None
    vendor, version = MPI.get_vendor()
    library = f"{vendor} {'.'.join(map(str, version))}"
    if lone.launcher == "srun":
        plugin = slurm_mpi_type()
        chosen = f"--mpi={plugin}" if plugin else "--mpi=none, or the cluster default MpiDefault"
        needed = SLURM_MPI_PLUGINS.get(vendor)
        why = (f"srun started this process as one of {lone.size} ({lone.announced}), but the MPI mpi4py loaded "
               f"({library}) made it a world of 1: srun's MPI plugin ({chosen}) does not start {vendor}")
        fix = (f"launch with `srun --mpi={needed} ...` ({vendor} needs {needed}; `srun --mpi=list` shows what the "
               f"cluster offers) or `commwire run -np {lone.size} ...` inside the allocation, which passes it"
               if needed else "launch with the srun --mpi plugin your MPI's documentation names "
                              "(`srun --mpi=list` shows what the cluster offers)")
    elif lone.launcher == "mpiexec":
        why = (f"the launcher started {lone.size} processes ({lone.announced}), but the MPI mpi4py loaded "
               f"({library}) made this one a world of 1: that mpiexec belongs to another MPI")
        fix = (f"launch with `commwire run -np {lone.size} ...`, which uses mpi4py's MPI, or with that MPI's own "
               "mpiexec")
    else:
        why = (f"{lone.launcher} started this process as one of {lone.size} ({lone.announced}), but MPI made it a "
               "world of 1: torch's launchers do not start MPI, and commwire's collectives run over MPI's world")
        fix = f"launch with `commwire run -np {lone.size} python ...` (or mpiexec, or srun) instead"
    return why, fix + "; to run one process alone on purpose, call commwire.init(comm=MPI.COMM_SELF)"


_settings: dict[str, Any] = {}
_generation = 0


def _make_transport(mpi_comm: Any, transport: str, cuda_aware: bool) -> Any:
    """Return the world's data transport (collective: every rank agrees on the choice first)."""
    choices = mpi_comm.allgather(transport)
    if len(set(choices)) > 1:
        raise ValueError(f"ranks asked for different transports: {dict(enumerate(choices))}; pass the same "
                         "init(transport=...) / COMMWIRE_TRANSPORT on every rank")
    if transport == "mpi":
        return MPITransport(mpi_comm, cuda_aware=cuda_aware)
    from .torch_transport import TorchTransport, default_backend, init_torch_distributed

    global _generation
    init_torch_distributed(mpi_comm, default_backend())
    import torch.distributed as dist

    _generation += 1  # every init() is collective: the groups of each world get names of their own
    return TorchTransport(dist.group.WORLD, prefix=f"commwire{_generation}")


def _validate_init(check: Any, timeline: Any, thread_level: Any, cuda_aware: Any, abort_on_error: Any,
                   timeout: Any, on_stall: Any) -> None:
    """Raise a clear error for any ``init()`` argument of the wrong type or value."""
    if check not in (None, False, True, "first"):
        raise ValueError(f"check={check!r} is not valid; use True (every call), 'first' (the default) or False")
    if timeline is not None and not isinstance(timeline, (str, os.PathLike)):
        raise TypeError(f"timeline={timeline!r} must be a file path (str or os.PathLike) or None")
    if thread_level is not None and thread_level not in THREAD_LEVELS:
        raise ValueError(f"thread_level={thread_level!r} is not valid; use one of {', '.join(THREAD_LEVELS)}")
    for flag, value in (("cuda_aware", cuda_aware), ("abort_on_error", abort_on_error)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{flag}={value!r} must be True, False or None (None: decide automatically)")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout={timeout!r} must be a number of seconds (e.g. 300; 0 disables the watchdog)")
        if not timeout >= 0:  # also refuses NaN
            raise ValueError(f"timeout={timeout!r} must be >= 0 seconds (0 disables the stall watchdog)")
    if on_stall is not None and on_stall not in ("abort", "warn"):
        raise ValueError(f"on_stall={on_stall!r} is not valid; use 'abort' or 'warn'")


def _check_reinit(world_comm: Communicator, **asked: Any) -> None:
    """Refuse a second ``init()`` that asks for settings other than those in force (never ignore them)."""
    changed = []
    for key, value in asked.items():
        if value is None:
            continue
        current = _settings.get(key)
        if key == "timeout":
            value = float(value)
        if key == "timeline":
            value = os.fspath(value)
        if value != current:
            changed.append(f"{key}={value!r} (in force: {current!r})")
    if changed:
        raise RuntimeError("commwire is already initialised; a second init() cannot change "
                           + ", ".join(changed) + ". Call commwire.finalize() first, or pass these to the first init()")


def _import_mpi(level: str) -> Any:
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.thread_level = level
    from mpi4py import MPI

    if not MPI.Is_initialized():
        MPI.Init_thread(THREAD_LEVELS.index(level))
        # mpi4py finalises at exit only an MPI it initialised at import (mpi4py.rc.initialize); one
        # initialised here must be finalised here, or the launcher takes the exit for a crash and
        # kills the ranks still running. Registered before commwire's own exit hook, so it runs after.
        atexit.register(_finalize_mpi)
    return MPI


def _finalize_mpi() -> None:
    import mpi4py
    from mpi4py import MPI

    # mpi4py.rc.finalize = False: the program finalises MPI itself, as it said
    if mpi4py.rc.finalize is not False and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def finalize() -> None:
    """Write the timeline (if any) and release commwire's world communicator.

    MPI itself is finalised by mpi4py at interpreter exit, so commwire can be
    initialised again in the same process.
    """
    global _world
    with _lock:
        world_comm, _world = _world, None
    if world_comm is None:
        return
    if world_comm.timeline is not None:
        world_comm.timeline.collect(world_comm.mpi)
    if world_comm.watchdog is not None:
        world_comm.watchdog.announce_exit()
        world_comm.watchdog.close()
    _settings.clear()


def replace_world(mpi_comm: Any) -> Communicator:
    """Make ``mpi_comm`` commwire's world, with the settings the old world had (commwire.elastic).

    For a world re-formed after a lost peer: the old world's communicators are
    broken, so nothing collective runs on them (no timeline gather, no exit
    announcement); they are dropped. Collective over ``mpi_comm``.
    """
    global _world, _resets
    with _lock:
        old, _world = _world, None
        settings = dict(_settings)
        _resets += 1
    if old is not None and old.watchdog is not None:
        old.watchdog.close()
    if old is not None and old.timeline is not None:
        old.timeline.close()  # its files stay as written; the new world's timeline goes to timeline_path()
    return init(comm=mpi_comm, check=old.check if old is not None else None, timeline=settings.get("timeline"),
                cuda_aware=settings.get("cuda_aware"), timeout=settings.get("timeout"),
                on_stall=settings.get("on_stall"), transport=settings.get("transport"))


def _finalize_at_exit() -> None:
    # Registered after mpi4py's own exit hook, so it runs first (atexit is LIFO)
    # while MPI is still usable.
    if _world is not None:
        finalize()


def start_timeline(path: str) -> None:
    """Start recording a Chrome-trace timeline of every communicator to ``path`` (call on every rank).

    A timeline already being recorded is completed first (its file written, as by ``stop_timeline()``).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"timeline path {path!r} must be a str or os.PathLike")
    comm = world()
    if comm.timeline is not None:  # as Horovod does, the new file takes over from the one being recorded
        stop_timeline()
    recorder = open_timeline(comm.mpi, os.fspath(path))
    from .communicator import live_communicators

    for c in live_communicators(comm.counters):
        c.timeline = recorder


def stop_timeline() -> None:
    """Stop the timeline and write it (collective: rank 0 writes every rank's events); no timeline: nothing."""
    comm = world()
    recorder = comm.timeline
    from .communicator import live_communicators

    for c in live_communicators(comm.counters):
        c.timeline = None
    if recorder is not None:
        recorder.collect(comm.mpi)


def open_timeline(mpi_comm: Any, path: str | None) -> Timeline | None:
    """Start a timeline on every rank of ``mpi_comm`` if rank 0 has a path; return this rank's recorder.

    Collective. Rank 0's path names the timeline, as Horovod's HOROVOD_TIMELINE does; a
    rank without a path of its own writes its part beside rank 0's. A rank that cannot
    create its file raises on every rank, naming it.
    """
    first = mpi_comm.bcast(os.fspath(path) if path else None, root=0)
    if first is None:
        return None
    mine = os.fspath(path) if path else first
    recorder, error = None, None
    try:
        recorder = Timeline(mine, mpi_comm.Get_rank())
    except OSError as exc:
        error = str(exc)
    errors = mpi_comm.allgather(error)
    if any(errors):
        if recorder is not None:
            recorder.discard()
        found = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        raise OSError(f"the timeline could not be started ({found})")
    return recorder


def timeline_path(path: str, launch: int, resets: int) -> str:
    """Return where an elastic job's timeline goes, so that no launch or re-formed world overwrites another's.

    ``launch``: how often the job was launched before (COMMWIRE_ELASTIC_VERSION); ``resets``: how often
    this process's world was re-formed in place since. trace.json, trace.reset1.json, trace.launch1.json,
    trace.launch1.reset2.json, ...
    """
    root, ext = os.path.splitext(os.fspath(path))
    tags = (f".launch{launch}" if launch else "") + (f".reset{resets}" if resets else "")
    return f"{root}{tags}{ext}"


def transport() -> str:
    """Return what carries the world's data: "mpi" or "torch" (raises if commwire is not initialised)."""
    world()
    return str(_settings.get("transport", "mpi"))


def is_initialized() -> bool:
    """Return whether ``init()`` has been called (and not finalised)."""
    return _world is not None


_NOT_INITIALISED = "commwire is not initialised: call commwire.init() first (hvd.init() with commwire.torch)"


def world() -> Communicator:
    """Return the world communicator; raise RuntimeError if ``init()`` has not been called."""
    if _world is None:
        raise RuntimeError(_NOT_INITIALISED)
    return _world


def default_comm(comm: Communicator | None = None, *, init_if_needed: bool = False) -> Communicator:
    """Return ``comm``, or the world communicator when ``comm`` is None: every adapter finds its communicator here.

    Args:
        comm: the communicator the caller was given, if any (returned as is).
        init_if_needed: when commwire is not initialised, call ``init()`` (its defaults and
            environment fallbacks) instead of raising. Only the GLM solvers and estimators ask for
            this: their documented quick start, ``GLM(...).fit(X, y)``, is a plain script without
            ``init()``, as scikit-learn code is. Collectives, the fusion buffer, schedules,
            checkpoints and the torch adapters raise, as Horovod's do before ``hvd.init()``.

    Raises:
        RuntimeError: commwire is not initialised and ``init_if_needed`` is False.
    """
    if comm is not None:
        return comm
    if _world is None and init_if_needed:
        return init()
    return world()


def rank() -> int:
    """Return this process's rank in the world communicator."""
    return world().rank


def size() -> int:
    """Return the number of ranks in the world communicator."""
    return world().size


def local_rank() -> int:
    """Return this process's rank among the ranks on the same node."""
    return world().node().rank


def local_size() -> int:
    """Return the number of ranks on this node."""
    return world().node().size


def new_group(ranks: list[int]) -> Communicator | None:
    """Return a communicator over ``ranks`` (None on ranks outside it)."""
    return world().new_group(ranks)


def stats(reset: bool = False) -> dict[str, Any]:
    """Return operation and codec counters of this process; ``reset`` zeroes them."""
    return _counters.snapshot(reset=reset)


def thread_level() -> str:
    """Return the MPI thread level actually provided."""
    world()
    return str(_thread_level)


def cuda_aware() -> bool:
    """Return whether CUDA buffers go to MPI directly (else they are host-staged)."""
    return world().cuda_aware


def _detect_cuda_aware() -> bool:
    setting = _config.cuda_aware_setting()
    if setting != "auto":
        return setting == "1"
    return query_mpi_cuda_support()


def query_mpi_cuda_support() -> bool:
    """Ask the loaded MPI library whether it accepts CUDA buffers (MPIX extension)."""
    import ctypes

    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            libs = {line.split()[-1] for line in fh if "/libmpi" in line}
    except OSError:
        return False
    for path in sorted(libs):
        if not os.path.exists(path):
            continue
        try:
            func = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        try:
            return bool(func())
        except Exception:  # noqa: BLE001 - a foreign library must not break init
            return False
    return False


def install_abort_hook() -> None:
    """Make an unhandled exception on this rank abort the whole MPI job.

    Without it a rank that raises exits while the others wait forever inside
    a collective. The hook prints the rank and traceback, then MPI_Abort.
    """
    if getattr(sys.excepthook, "_commwire", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        report_and_abort("".join(traceback.format_exception(exc_type, exc, tb)))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        report_and_abort(f"in thread {getattr(args.thread, 'name', '?')}:\n{text}")

    hook._commwire = True  # type: ignore[attr-defined]
    sys.excepthook = hook
    threading.excepthook = thread_hook


def report_and_abort(text: str, status: str = "raised") -> None:
    """Record ``status`` in this rank's status file, print the rank and ``text`` to stderr, and abort the job.

    The rank comes from MPI when it is running, else from the launcher's variables
    (a failure before ``init()``); ``text`` is usually a traceback.
    """
    from mpi4py import MPI

    from .rankenv import launcher_ranks
    from .ranklog import record

    record(status, text.strip().splitlines()[-1] if text.strip() else "")

    if MPI.Is_initialized() and not MPI.Is_finalized():
        who, total = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    else:
        announced = launcher_ranks()
        who, total = ("?" if v is None else v for v in (announced.rank, announced.size))
    sys.stdout.flush()
    stream = _report_stream()
    stream.write(f"commwire: rank {who} of {total} raised an unhandled exception; aborting the job\n{text}")
    stream.flush()
    abort_world(1)


def _report_stream() -> Any:
    """Return a stream that reaches this rank's stderr.

    Another excepthook may call ours with sys.stderr pointed at a buffer it prints
    afterwards (torch.distributed's prefixes each line with the rank); we abort before
    it can, so the report goes to a stream with a file descriptor behind it.
    """
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__


def abort_world(code: int, grace: float = 5.0) -> None:
    """Call MPI_Abort, and exit anyway if it has not ended this process after ``grace`` seconds.

    MPI_Abort asks the launcher to kill the job; when the launcher is out of
    reach (a host cut off the network) the call can block forever, which would
    leave this rank behind as an orphan.
    """
    from mpi4py import MPI

    threading.Timer(grace, os._exit, (code,)).start()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)
