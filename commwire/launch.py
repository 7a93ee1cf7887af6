"""Find the MPI launcher and build the command line that starts N ranks.

Supported: MPICH's and Intel MPI's ``mpiexec`` (Hydra), Open MPI's
``mpirun``/``mpiexec``, and ``srun`` inside a Slurm allocation. The launcher in
the active environment (``sys.prefix/bin``, where ``pip install mpich`` puts
it) wins over one on PATH, so ranks use the MPI that mpi4py was built for.
Hosts come as ``-H host:slots,...`` or a hostfile (``host slots=N`` lines, as
horovodrun takes them), and reach each launcher in its own syntax.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

from ._validate import positive_int
from .comm.rankenv import SLURM_MPI_PLUGINS, is_this_machine, slurm_mpi_type

__all__ = ["Launcher", "LAUNCHER_KINDS", "find_launcher", "build_command", "parse_hosts", "parse_hostfile",
           "hosts_are_local", "check_command", "wrap_python", "wrap_program", "slurm_mpi_plugin", "mpi4py_vendor",
           "srun_mpi_plugins"]

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
    mpi_plugin: str | None = None
    """srun only: the ``--mpi`` plugin that starts mpi4py's MPI as one job (None: srun's default)."""
    mpi_plugins_offered: tuple[str, ...] = ()
    """srun only: the plugins ``srun --mpi=list`` names (empty: not known)."""


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
            plugin = slurm_mpi_plugin()
            return Launcher(kind="slurm", path=srun, mpi_plugin=plugin,
                            mpi_plugins_offered=tuple(srun_mpi_plugins(srun)) if plugin else ())
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


def slurm_mpi_plugin(vendor: str | None = None) -> str | None:
    """Return the ``srun --mpi`` plugin mpi4py's MPI needs (MPICH: pmi2, Open MPI: pmix).

    None where SLURM_MPI_TYPE already chooses one, or the MPI is not known. Without
    a plugin the MPI understands, srun starts every rank as a world of its own.
    """
    if slurm_mpi_type():
        return None
    return SLURM_MPI_PLUGINS.get((vendor if vendor is not None else mpi4py_vendor()) or "")


def mpi4py_vendor() -> str | None:
    """Return the vendor of the MPI mpi4py loads ("MPICH", "Open MPI", ...), without starting MPI here."""
    code = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.get_vendor()[0])"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def srun_mpi_plugins(srun: str) -> list[str]:
    """Return the MPI plugins ``srun --mpi=list`` names (pmi2, pmix, pmix_v4, ...); [] if it cannot tell."""
    try:
        proc = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = []
    for line in (proc.stdout + proc.stderr).splitlines():
        if line[:1].isspace() and re.fullmatch(r"[A-Za-z0-9_]+", line.strip()):
            names.append(line.strip())
        elif "plugin versions available:" in line:
            names += [n.strip() for n in line.split(":", 1)[1].split(",") if n.strip()]
    return names


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


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """Parse a hostfile into (host, slots) pairs.

    Lines are ``host slots=N`` (horovodrun's and Open MPI's format), ``host:N``
    (Hydra's) or ``host``; ``#`` starts a comment; ``max_slots=`` is ignored.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ValueError(f"hostfile {path!r} cannot be read ({exc.strerror}); give an existing file") from None
    pairs = []
    for number, line in enumerate(lines, 1):
        words = line.partition("#")[0].split()
        if not words:
            continue
        host, _, slots = words[0].partition(":")
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "slots" and not slots:
                slots = value
            elif key != "max_slots":
                slots = "bad"
        if not host or (slots and not slots.isdigit()) or slots == "0":
            raise ValueError(f"{path}:{number}: {line.strip()!r} is not 'host slots=N', 'host:N' or 'host'")
        pairs.append((host, int(slots or 1)))
    if not pairs:
        raise ValueError(f"hostfile {path!r} names no host; write one 'host slots=N' line per host")
    return pairs


def hosts_are_local(pairs: Sequence[tuple[str, int]] | None) -> bool:
    """Return whether every host in ``pairs`` (None: no hosts given) is this machine."""
    return not pairs or all(is_this_machine(host) for host, _ in pairs)


_PY_OPTS_WITH_VALUE = {"-W", "-X", "-Q"}
_FIND_MODULE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"


def _is_python(program: str) -> bool:
    return re.fullmatch(r"python(\d+(\.\d+)?)?", os.path.basename(program)) is not None


def _python_target(command: Sequence[str]) -> int | None:
    """Return the index of ``script``/``-m``/``-c`` in a ``python [opts] ...`` command, else None."""
    if not command or not _is_python(command[0]):
        return None
    i = 1
    while i < len(command) and command[i].startswith("-") and command[i] not in ("-m", "-c", "-"):
        i += 2 if command[i] in _PY_OPTS_WITH_VALUE else 1
    if i >= len(command) or command[i] == "-":
        return None  # interactive / stdin: nothing to wrap
    return i


def wrap_python(command: Sequence[str], options: Sequence[str] = ()) -> list[str]:
    """Run a ``python ...`` command under commwire's per-rank wrapper.

    ``python [opts] script|-m mod|-c code args`` becomes
    ``python [opts] -m commwire._rankmain [options] script|-m mod|-c code args``;
    other commands are returned unchanged.
    """
    i = _python_target(command)
    if i is None:
        return list(command)
    return [*command[:i], "-m", "commwire._rankmain", *options, *command[i:]]


def wrap_program(command: Sequence[str], options: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """Run any command under the per-rank wrapper: python ones as `wrap_python` does, others via ``--exec``.

    A program that is not Python runs as a child of ``python -m commwire._rankmain
    [options] --exec``, which tags its output; without ``options`` it runs as is.
    Interactive python is left alone.
    """
    if not command or _is_python(command[0]):
        return wrap_python(command, options)
    if not options:
        return list(command)
    return [python, "-m", "commwire._rankmain", *options, "--exec", *command]


def check_command(command: Sequence[str], env: dict[str, str] | None = None) -> None:
    """Raise FileNotFoundError, naming it and the fix, if the program or Python script cannot start here.

    ``env`` is the ranks' environment (its PATH and PYTHONPATH are used).
    """
    if not command:
        raise ValueError("no command to run; e.g. commwire run -np 4 python train.py")
    env = dict(os.environ if env is None else env)
    program = command[0]
    if os.sep in program:
        if not os.path.isfile(program):
            raise FileNotFoundError(f"program {program!r} not found (no such file from {os.getcwd()}); "
                                    "check the path")
        if not os.access(program, os.X_OK):
            raise FileNotFoundError(f"program {program!r} is not executable; chmod +x it or run it through "
                                    "its interpreter")
    elif shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(f"program {program!r} not found on PATH; check the spelling, give its full "
                                "path, or activate the environment that has it")
    i = _python_target(command)
    if i is None or command[i] == "-c":
        return
    if command[i] != "-m":
        if not os.path.isfile(command[i]):
            raise FileNotFoundError(f"python script {command[i]!r} not found (looked in {os.getcwd()}); "
                                    "check the path")
        return
    if i + 1 >= len(command):
        raise ValueError(f"{program} -m needs a module name; e.g. commwire run -np 2 {program} -m pkg.train")
    try:
        found = subprocess.run([program, "-c", _FIND_MODULE, command[i + 1]], capture_output=True, env=env,
                               timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        return  # cannot tell here: let the ranks report it
    if found == 3:
        raise FileNotFoundError(f"{program} finds no module {command[i + 1]!r} (from {os.getcwd()}); check the "
                                "name, the working directory, or install the package")


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
    positive_int("-np", np, extra="(at least 1 rank)")
    if not command:
        raise ValueError("no command to run; e.g. commwire run -np 4 python train.py")
    if hosts and hostfile:
        raise ValueError("give either -H/--hosts or --hostfile, not both")
    if hostfile and not os.path.isfile(hostfile):
        raise ValueError(f"hostfile {hostfile!r} does not exist")
    env = dict(env or {})
    # A hostfile is read here, so every launcher gets the same hosts whatever
    # format the file is in (horovodrun's `host slots=N` is not Hydra's).
    host_pairs = parse_hosts(hosts) if hosts else parse_hostfile(hostfile) if hostfile else None
    argv = [launcher.path]
    if launcher.kind == "slurm":
        argv += ["-n", str(np), "--export=" + ",".join(["ALL"] + [f"{k}={v}" for k, v in env.items()])]
        # As mpiexec does, end the job when a rank dies: by default srun lets the others wait for it for ever.
        if not any(a.startswith(("--kill-on-bad-exit", "-K")) for a in mpi_args or []):
            argv.append("--kill-on-bad-exit=1")
        needed, offered = launcher.mpi_plugin, launcher.mpi_plugins_offered
        if needed and not any(a == "--mpi" or a.startswith("--mpi=") for a in mpi_args or []):
            if offered and not any(p == needed or p.startswith(needed + "_") for p in offered):
                raise ValueError(f"srun offers the MPI plugins {', '.join(offered)}, not {needed}, which mpi4py's MPI "
                                 f"needs to start the ranks as one job; pass a plugin that works for this MPI with "
                                 f"--mpi-args=--mpi=NAME (or set SLURM_MPI_TYPE), or ask the cluster's admins for "
                                 f"{needed}")
            argv.append(f"--mpi={needed}")
        if host_pairs:
            argv.append("--nodelist=" + ",".join(h for h, _ in host_pairs))
    elif launcher.kind == "openmpi":
        argv += ["-np", str(np), "--oversubscribe"]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        if host_pairs:
            argv += ["-H", ",".join(f"{h}:{s}" for h, s in host_pairs)]
        for key, value in env.items():
            argv += ["-x", f"{key}={value}"]
    else:  # Hydra: MPICH and Intel MPI
        argv += ["-n", str(np)]
        if host_pairs:
            if launcher.kind == "mpich":
                argv += ["-hosts", ",".join(f"{h}:{s}" for h, s in host_pairs)]
            else:
                argv += ["-machinefile", _machinefile(host_pairs)]
        for key, value in env.items():
            argv += ["-genv", key, value]
    return argv + list(mpi_args or []) + list(command)


def _machinefile(pairs: list[tuple[str, int]]) -> str:
    fd, path = tempfile.mkstemp(prefix="commwire-hosts-", suffix=".txt")
    with os.fdopen(fd, "w") as fh:
        fh.writelines(f"{h}:{s}\n" for h, s in pairs)
    return path
