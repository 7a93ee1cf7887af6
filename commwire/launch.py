"""Find the MPI launcher and build the command line that starts N ranks.

Supported: MPICH's and Intel MPI's ``mpiexec`` (Hydra), Open MPI's
``mpirun``/``mpiexec``, and ``srun`` inside a Slurm allocation. The launcher in
the active environment (``sys.prefix/bin``, where ``pip install mpich`` puts
it) wins over one on PATH, so ranks use the MPI that mpi4py was built for.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["Launcher", "LAUNCHER_KINDS", "find_launcher", "build_command", "parse_hosts", "wrap_python"]

LAUNCHER_KINDS = ("mpich", "intel", "openmpi", "slurm")
_NO_LAUNCHER = (
    "no MPI launcher found (looked for mpiexec/mpirun in {where} and srun in a Slurm allocation); "
    "install one with: pip install 'commwire[mpich]'"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Launcher:
    """An MPI launcher executable and the flavour of flags it understands."""

    kind: str
    path: str


def _vendor(path: str) -> str | None:
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = proc.stdout + proc.stderr
    if "Intel(R) MPI" in text:
        return "intel"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    if "Open MPI" in text or "OpenRTE" in text or "open-mpi" in text:
        return "openmpi"
    return None


def find_launcher(kind: str | None = None) -> Launcher:
    """Return the launcher to use; ``kind`` forces one of LAUNCHER_KINDS."""
    if kind is not None and kind not in LAUNCHER_KINDS:
        raise ValueError(f"launcher {kind!r} is unknown; use one of {', '.join(LAUNCHER_KINDS)}")
    if kind in (None, "slurm") and os.environ.get("SLURM_JOB_ID"):
        srun = shutil.which("srun")
        if srun:
            return Launcher(kind="slurm", path=srun)
    if kind == "slurm":
        raise RuntimeError("--launcher slurm needs srun inside a Slurm allocation (SLURM_JOB_ID is unset)")
    local_bin = os.path.join(sys.prefix, "bin")
    candidates = [os.path.join(local_bin, name) for name in ("mpiexec", "mpirun")]
    candidates += [p for p in (shutil.which("mpiexec"), shutil.which("mpirun")) if p]
    for path in dict.fromkeys(candidates):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            continue
        vendor = _vendor(path)
        if vendor is not None and (kind is None or vendor == kind):
            return Launcher(kind=vendor, path=path)
    raise RuntimeError(_NO_LAUNCHER.format(where=f"{local_bin} and PATH"))


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """Parse ``host:slots,host2:slots`` (slots default to 1) into pairs."""
    pairs = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        host, _, slots = item.partition(":")
        if not host or (slots and not slots.isdigit()) or slots == "0":
            raise ValueError(f"host entry {item!r} is not HOST or HOST:SLOTS (e.g. node1:4)")
        pairs.append((host, int(slots or 1)))
    if not pairs:
        raise ValueError(f"hosts {spec!r} names no host; use e.g. node1:4,node2:4")
    return pairs


_PY_OPTS_WITH_VALUE = {"-W", "-X", "-Q"}


def wrap_python(command: list[str]) -> list[str]:
    """Run a ``python ...`` command under commwire's abort-on-exception wrapper.

    ``python [opts] script|-m mod|-c code args`` becomes
    ``python [opts] -m commwire._rankmain script|-m mod|-c code args``; other
    commands are returned unchanged.
    """
    if not command or not re.fullmatch(r"python(\d+(\.\d+)?)?", os.path.basename(command[0])):
        return list(command)
    i = 1
    while i < len(command) and command[i].startswith("-") and command[i] not in ("-m", "-c", "-"):
        i += 2 if command[i] in _PY_OPTS_WITH_VALUE else 1
    if i >= len(command) or command[i] == "-":
        return list(command)  # interactive / stdin: nothing to wrap
    return command[:i] + ["-m", "commwire._rankmain"] + command[i:]


def build_command(
    launcher: Launcher,
    np: int,
    command: list[str],
    *,
    hosts: str | None = None,
    hostfile: str | None = None,
    env: dict[str, str] | None = None,
    mpi_args: list[str] | None = None,
) -> list[str]:
    """Return the argv that starts ``command`` on ``np`` ranks with ``launcher``."""
    if np < 1:
        raise ValueError(f"-np {np} must be at least 1")
    if not command:
        raise ValueError("no command to run; e.g. commwire run -np 4 python train.py")
    if hosts and hostfile:
        raise ValueError("give either -H/--hosts or --hostfile, not both")
    if hostfile and not os.path.isfile(hostfile):
        raise ValueError(f"hostfile {hostfile!r} does not exist")
    env = dict(env or {})
    host_pairs = parse_hosts(hosts) if hosts else None
    argv = [launcher.path]
    if launcher.kind == "slurm":
        argv += ["-n", str(np), "--export=" + ",".join(["ALL"] + [f"{k}={v}" for k, v in env.items()])]
        if host_pairs:
            argv.append("--nodelist=" + ",".join(h for h, _ in host_pairs))
        if hostfile:
            argv.append(f"--nodefile={hostfile}")
    elif launcher.kind == "openmpi":
        argv += ["-np", str(np), "--oversubscribe"]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        if host_pairs:
            argv += ["-H", ",".join(f"{h}:{s}" for h, s in host_pairs)]
        if hostfile:
            argv += ["--hostfile", hostfile]
        for key, value in env.items():
            argv += ["-x", f"{key}={value}"]
    else:  # Hydra: MPICH and Intel MPI
        argv += ["-n", str(np)]
        if host_pairs:
            if launcher.kind == "mpich":
                argv += ["-hosts", ",".join(f"{h}:{s}" for h, s in host_pairs)]
            else:
                argv += ["-machinefile", _machinefile(host_pairs)]
        if hostfile:
            argv += ["-f", hostfile]
        for key, value in env.items():
            argv += ["-genv", key, value]
    return argv + list(mpi_args or []) + list(command)


def _machinefile(pairs: list[tuple[str, int]]) -> str:
    fd, path = tempfile.mkstemp(prefix="commwire-hosts-", suffix=".txt")
    with os.fdopen(fd, "w") as fh:
        fh.writelines(f"{h}:{s}\n" for h, s in pairs)
    return path
