"""``commwire.run``: run a Python function on N ranks and get each rank's return value (``horovod.run``).

The function and its arguments are pickled into a temporary folder and
``commwire run`` starts ``python -m commwire.runfunc FOLDER`` on every rank
(so every option of the CLI works here too: hosts, elastic, horovodrun's
flags). Each rank unpickles the function, calls it and writes its return value
back; the caller gets the values in rank order.

A function is pickled by reference (its module and name), as multiprocessing's
"spawn" does: one defined in the calling script is found because each rank
first runs that script as module ``__mp_main__`` (its ``if __name__ ==
"__main__":`` part does not run again). Lambdas, closures and functions of an
interactive session need ``cloudpickle`` (pickled by value), which is used
when it is installed.
"""

from __future__ import annotations

import os
import pickle
import runpy
import shutil
import subprocess
import sys
import tempfile
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["run"]


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, num_proc: int = 1,
        min_num_proc: int | None = None, max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: tuple[float, float] | None = None,
        hosts: str | None = None, hostfile: str | None = None, host_discovery_script: str | None = None,
        start_timeout: float | None = None, ssh_port: int | None = None, ssh_identity_file: str | None = None,
        disable_cache: bool | None = None, output_filename: str | None = None, verbose: bool | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None, mpi_args: str | None = None,
        network_interface: str | None = None, network_interfaces: Sequence[str] | None = None,
        executable: str | None = None, np: int | None = None, min_np: int | None = None,
        max_np: int | None = None) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks; return the values in rank order (horovod.run).

    The arguments are ``horovod.run``'s, with the meaning of the ``commwire run``
    options they stand for (``np``/``min_np``/``max_np`` and
    ``network_interface`` are its deprecated spellings). With ``min_num_proc``
    (elastic) only the first ``min_num_proc`` values are returned, as Horovod
    does. A rank that raises ends the job: the traceback is printed with the
    ranks' output and a RuntimeError is raised here.
    """
    if network_interface:
        warnings.warn("network_interface is deprecated, use network_interfaces instead", DeprecationWarning,
                      stacklevel=2)
        network_interfaces = network_interface.split(",")
    for old, given, new in (("np", np, "num_proc"), ("min_np", min_np, "min_num_proc"),
                            ("max_np", max_np, "max_num_proc")):
        if given is not None:
            warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, stacklevel=2)
    num_proc = np if np is not None else num_proc
    min_num_proc = min_np if min_np is not None else min_num_proc
    max_num_proc = max_np if max_np is not None else max_num_proc
    if hosts is not None and hostfile is not None:
        raise ValueError("give either hosts or hostfile, not both")
    if not callable(func):
        raise TypeError(f"func={func!r} is not callable; pass the function each rank runs")
    folder = tempfile.mkdtemp(prefix="commwire-run-")
    try:
        _write_job(folder, func, tuple(args), dict(kwargs or {}))
        cli = [sys.executable, "-m", "commwire", "run", "-np", str(num_proc)]
        options: list[tuple[str, Any]] = [
            ("--min-np", min_num_proc), ("--max-np", max_num_proc), ("--slots-per-host", slots),
            ("--reset-limit", reset_limit), ("-H", hosts), ("--hostfile", hostfile),
            ("--host-discovery-script", host_discovery_script), ("--start-timeout", start_timeout),
            ("-p", ssh_port), ("-i", ssh_identity_file), ("--output-filename", output_filename),
            ("--mpi-args", mpi_args),
            ("--network-interfaces", ",".join(network_interfaces) if network_interfaces else None)]
        for flag, value in options:
            if value is not None:
                cli += [flag, str(value)]
        if cooldown_range is not None:
            cli += ["--blacklist-cooldown-range", *map(str, cooldown_range)]
        for flag, on in (("--disable-cache", disable_cache), ("--verbose", verbose), ("--gloo", use_gloo),
                         ("--mpi", use_mpi)):
            if on:
                cli.append(flag)
        cli += [executable or sys.executable, "-m", "commwire.runfunc", folder]
        status = subprocess.run(cli).returncode
        if status != 0:
            raise RuntimeError(f"commwire.run: the job of {func.__qualname__} failed (exit status {status}); the "
                               "failing rank's traceback is in the output above")
        values = read_results(folder)
        return values[:min_num_proc] if min_num_proc is not None else values
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_results(folder: str) -> list[Any]:
    """Return the values the ranks of the job's last launch wrote, in rank order.

    An elastic job may be launched several times; a rank of an earlier launch whose
    function returned before the job was re-formed left a result of its own, which
    does not count (``result.LAUNCH.RANK``).
    """
    found: dict[int, dict[int, str]] = {}
    for name in os.listdir(folder):
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "result" and parts[1].isdigit() and parts[2].isdigit():
            found.setdefault(int(parts[1]), {})[int(parts[2])] = name
    if not found:
        return []
    last = found[max(found)]
    values = []
    for rank in sorted(last):
        with open(os.path.join(folder, last[rank]), "rb") as fh:
            values.append(pickle.load(fh))
    return values


def _write_job(folder: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    main = sys.modules.get("__main__")
    main_path = getattr(main, "__file__", None)
    try:
        payload = pickle.dumps((func, args, kwargs))
        if getattr(func, "__module__", None) == "__main__" and main_path is None:
            raise pickle.PicklingError("it is defined in an interactive session")
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(f"commwire.run cannot pickle {func!r} ({exc}): define it at module level in a file, "
                            "or pip install cloudpickle (which pickles lambdas and closures)") from None
        payload = cloudpickle.dumps((func, args, kwargs))
    with open(os.path.join(folder, "job.pkl"), "wb") as fh:
        pickle.dump({"main": os.path.abspath(main_path) if main_path else None, "payload": payload}, fh)


def _load_main(path: str) -> None:
    """Run the caller's script as ``__mp_main__`` and make it ``__main__``, as multiprocessing's spawn does."""
    sys.path.insert(0, os.path.dirname(path))
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def main(argv: Sequence[str] | None = None) -> None:
    """Each rank: load the job of ``argv[0]``, call the function, write its value as ``result.LAUNCH.RANK``."""
    from .comm.ranklog import env_rank
    from .elastic.runner import launch_version

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        raise SystemExit("usage: python -m commwire.runfunc FOLDER (started by commwire.run)")
    folder = argv[0]
    with open(os.path.join(folder, "job.pkl"), "rb") as fh:
        job = pickle.load(fh)
    if job["main"]:
        _load_main(job["main"])
    func, args, kwargs = pickle.loads(job["payload"])
    value = func(*args, **kwargs)
    from .comm import runtime

    # the rank in commwire's world if the function left it running (an elastic job renumbers), else the launcher's
    rank = str(runtime.rank()) if runtime.is_initialized() else env_rank()
    part = os.path.join(folder, f".result.{rank}.{os.getpid()}")
    with open(part, "wb") as fh:
        pickle.dump(value, fh)
    os.replace(part, os.path.join(folder, f"result.{launch_version()}.{rank}"))


if __name__ == "__main__":
    main()
