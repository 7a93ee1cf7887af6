"""The ``commwire`` command line: run, info, bench, lab.

Commands only parse arguments and delegate to library functions
(``commwire.launch``, ``commwire.info``, ``commwire.bench.*``, ``commwire.lab``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from typing import Sequence

import click

from .. import launch

__all__ = ["cli", "main"]

_PASSTHROUGH = {"ignore_unknown_options": True, "allow_interspersed_args": False}
BENCHMARKS = {  # name -> module under commwire.bench
    "allreduce": "allreduce",
    "codecs": "codecs",
    "glm": "glm",
    "torch": "torch_ddp",
    "faults": "faults",
    "gift": "gift",
    "project": "project",
    "suite": "suite",
}
# Benchmarks that launch their own MPI jobs: never run under mpiexec; -np N becomes their --np N.
DRIVERS = {"suite", "faults"}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="commwire")
def cli() -> None:
    """commwire: fewer bytes, messages and synchronisations for distributed training."""


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not key.isidentifier():
            raise click.BadParameter(f"{item!r} is not VAR or VAR=value", param_hint="-x")
        env[key] = value if sep else os.environ.get(key, "")
    return env


def _spawn(argv: list[str], env: dict[str, str]) -> int:
    # The launcher gets its own process group so Ctrl-C/SIGTERM here end every
    # rank it started, and no orphan is left behind.
    proc = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        # Whatever of the job is still in the launcher's process group (ranks or
        # proxies cut off from a failed launcher) goes with it: no orphans.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@cli.command(context_settings=_PASSTHROUGH)
@click.option("-np", "-n", "np_", type=int, default=1, show_default=True, help="number of ranks")
@click.option("-H", "--hosts", help="hosts and slots, e.g. node1:4,node2:4")
@click.option("--hostfile", type=click.Path(), help="hostfile in the launcher's format")
@click.option("-x", "env_pairs", multiple=True, metavar="VAR[=value]", help="export a variable to all ranks")
@click.option("--mpi-args", default="", help='extra launcher flags, quoted: --mpi-args "-bind-to core"')
@click.option("--timeline", type=click.Path(), help="write a Chrome-trace timeline of all ranks here")
@click.option("--check", is_flag=True, help="verify ranks agree on every collective's arguments")
@click.option("--launcher", "launcher_kind", type=click.Choice(launch.LAUNCHER_KINDS), help="force a launcher")
@click.option("--lab", is_flag=True, help="launch across the hosts of the emulated cluster (commwire lab up)")
@click.option("--no-wrap", is_flag=True, help="do not run python commands under the abort-on-error wrapper")
@click.option("--dry-run", is_flag=True, help="print the launch command instead of running it")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run(np_: int, hosts: str | None, hostfile: str | None, env_pairs: tuple[str, ...], mpi_args: str,
        timeline: str | None, check: bool, launcher_kind: str | None, lab: bool, no_wrap: bool,
        dry_run: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND on N ranks through the MPI launcher found (MPICH, Open MPI, Intel MPI, Slurm).

    An unhandled exception on any rank aborts the whole job with that rank's
    number and traceback; the exit status is non-zero.
    """
    import shlex

    env = {"COMMWIRE_RUN": "1", **_parse_env(env_pairs)}
    if timeline:
        env["COMMWIRE_TIMELINE"] = os.path.abspath(timeline)
    if check:
        env["COMMWIRE_CHECK"] = "1"
    cmd = list(command) if no_wrap else launch.wrap_python(list(command))
    try:
        if lab:
            if hosts or hostfile or launcher_kind:
                raise ValueError("--lab chooses the hosts and launcher itself; drop -H/--hostfile/--launcher")
            from .. import lab as lab_mod

            prefix, lab_env = lab_mod.launch_args(np_, {**os.environ, **env})
            argv = prefix + shlex.split(mpi_args) + cmd
            env = {k: v for k, v in lab_env.items() if os.environ.get(k) != v}
        else:
            launcher = launch.find_launcher(launcher_kind)
            argv = launch.build_command(launcher, np_, cmd, hosts=hosts, hostfile=hostfile, env=env,
                                        mpi_args=shlex.split(mpi_args))
    except (RuntimeError, ValueError, PermissionError) as exc:
        raise click.ClickException(str(exc)) from exc
    if dry_run:
        click.echo(shlex.join(argv))
        return
    sys.exit(_run_and_report(argv, env, np_))


def _run_and_report(argv: list[str], env: dict[str, str], np_: int) -> int:
    """Run the launcher; on failure name the ranks that failed and how (from their status files)."""
    import shutil
    import tempfile

    from ..comm.ranklog import summarize

    run_dir = tempfile.mkdtemp(prefix="commwire-run-")
    try:
        status = _spawn(argv, {**env, "COMMWIRE_RUN_DIR": run_dir})
        if status != 0:
            time.sleep(0.2)  # let the ranks' guardians record the last deaths
            click.echo(f"commwire run: the job failed (launcher exit status {status})", err=True)
            for line in summarize(run_dir, np_):
                click.echo(f"  {line}", err=True)
        return status
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@cli.command()
def info() -> None:
    """Print versions, MPI vendor and library, thread level, CUDA-aware support and devices."""
    from ..info import collect, format_info

    click.echo(format_info(collect()))


@cli.command(context_settings={"ignore_unknown_options": True})
@click.argument("name", type=click.Choice(sorted(BENCHMARKS)))
@click.option("-np", "-n", "np_", type=int, default=None, help="launch the benchmark on N local ranks")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(name: str, np_: int | None, args: tuple[str, ...]) -> None:
    """Run benchmark NAME (extra ARGS go to it; ``commwire bench NAME -- --help`` lists them).

    \b
    allreduce  plain and compressed all-reduce vs raw mpi4py Allreduce
    codecs     codec encode/decode throughput vs memcpy, round-trip error
    glm        GLM SGD vs CA-SGD (s-step Gram exchange)
    torch      DistributedOptimizer vs torch DDP over gloo, codecs, fusion, overlap
    faults     kill -9 / raise / stall / link-cut jobs: each ends in time, failing rank named
    gift       GIFT vs direct/block FP8, error feedback, Hadamard on real LM gradients; training runs
    project    alpha-beta cost model: fit on measurements, validate, project to 1024 nodes
    suite      all of allreduce, glm, torch (loopback and --lab bandwidths): JSON + Markdown + PNG report
    """
    module = f"commwire.bench.{BENCHMARKS[name]}"
    if importlib.util.find_spec(module) is None:
        raise click.ClickException(f"benchmark {name!r} is not installed in this commwire build")
    if name in DRIVERS:
        # A driver starts `commwire run` jobs itself: run it here, with -np passed on to it.
        forwarded = ["--np", str(np_)] if np_ is not None else []
        sys.exit(importlib.import_module(module).main([*forwarded, *args]) or 0)
    if np_ is not None and np_ > 1:
        try:
            argv = launch.build_command(launch.find_launcher(), np_, [sys.executable, "-m", module, *args],
                                        env={"COMMWIRE_RUN": "1"})
        except (RuntimeError, ValueError) as exc:
            raise click.ClickException(str(exc)) from exc
        sys.exit(_spawn(argv, {"COMMWIRE_RUN": "1"}))
    sys.exit(importlib.import_module(module).main(list(args)) or 0)


@cli.group()
def lab() -> None:
    """Build an emulated multi-host cluster on this machine (needs root, ip and tc)."""


@lab.command("up")
@click.option("--hosts", type=int, default=4, show_default=True, help="number of emulated hosts")
@click.option("--bandwidth", default="1gbit", show_default=True, help="link limit, e.g. 100mbit, 1gbit, 10gbit")
def lab_up(hosts: int, bandwidth: str) -> None:
    """Create the hosts, the bridge and the bandwidth limits (idempotent)."""
    from .. import lab as lab_mod

    click.echo(_lab_call(lambda: lab_mod.up(hosts=hosts, bandwidth=bandwidth)).describe())


@lab.command("down")
def lab_down() -> None:
    """Remove every namespace, link and file the lab created (also leftovers)."""
    from .. import lab as lab_mod

    removed = _lab_call(lab_mod.down)
    click.echo("removed: " + (", ".join(removed) if removed else "nothing (no lab was up)"))


@lab.command("status")
def lab_status() -> None:
    """Show the lab's hosts, addresses and limits, or say that none is up."""
    from .. import lab as lab_mod

    spec = _lab_call(lab_mod.status)
    click.echo(spec.describe() if spec is not None else "no lab is up (commwire lab up --hosts 4)")


@lab.command("cut")
@click.argument("host")
def lab_cut(host: str) -> None:
    """Take HOST's link down (its ranks lose the network)."""
    from .. import lab as lab_mod

    click.echo(f"{_lab_call(lambda: lab_mod.cut(host))}: link down")


@lab.command("heal")
@click.argument("host")
def lab_heal(host: str) -> None:
    """Bring HOST's link back up."""
    from .. import lab as lab_mod

    click.echo(f"{_lab_call(lambda: lab_mod.heal(host))}: link up")


def _lab_call(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except (RuntimeError, ValueError, PermissionError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc


def main(args: Sequence[str] | None = None) -> int:
    """Run the CLI with ``args`` (default: sys.argv[1:]) and return the exit status."""
    try:
        cli.main(args=list(args) if args is not None else None, prog_name="commwire", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted!", err=True)
        return 1
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
