"""Run the benchmark suite and write one report: ``suite.json``, ``suite.md`` and PNG plots.

The suite is a driver, not an MPI program: it launches each benchmark as its own
``commwire run -np N python -m commwire.bench.NAME --json ...`` job, one after the
other, collects the rows each writes, and renders them. Parts:

- on loopback (ranks on this machine): ``allreduce`` (commwire FP32 vs mpi4py,
  then each codec vs FP32 MPI) and ``glm`` (CA-SGD vs SGD);
- for each bandwidth given to ``--lab``: a lab of 4 emulated hosts at that
  bandwidth is brought up (and torn down afterwards, also on Ctrl-C), and
  ``allreduce``, ``glm`` and ``torch`` (DistributedOptimizer vs DDP) run across it.

Every figure is a ratio against a baseline measured in the same job; the report
puts those ratios first, with a headline table of one key ratio per part. A part
that fails is recorded (exit status, last stderr lines) and the suite carries on;
the exit status is 1 when any part failed.

Run: ``commwire bench suite --out reports/suite [--np 4] [--quick] [--lab 10gbit,1gbit]
[--only allreduce,glm,torch] [--quiet]``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from ..lab.netns import signals_raise
from ._progress import Steps
# The rendering lives in _suite_report so this module stays about running the suite; headline and
# write_report are re-exported because they belong to this module's API.
from ._suite_report import PLOTS_MISSING, display_argv, headline, write_json, write_report

__all__ = [
    "BENCHES", "LOOPBACK_BENCHES", "LAB_BENCHES", "LAB_HOSTS", "CODECS",
    "SuiteConfig", "Part", "PartResult", "SuiteOutcome", "Progress",
    "parse_only", "parse_lab", "plan", "part_argv", "run_part", "run_suite", "headline", "write_report",
    "NAME", "HELP", "DRIVER", "build_parser", "main",
]

NAME = "suite"
HELP = "all of allreduce, glm, torch (loopback and --lab bandwidths): JSON + Markdown + PNG report"
DRIVER = True

BENCHES = ("allreduce", "glm", "torch")
"""Names accepted by ``--only``."""
LOOPBACK_BENCHES = ("allreduce", "glm")
"""Benchmarks run with all ranks on this machine."""
LAB_BENCHES = ("allreduce", "glm", "torch")
"""Benchmarks run across the emulated hosts of each ``--lab`` bandwidth."""
LAB_HOSTS = 4
"""Emulated hosts of every lab the suite brings up."""
CODECS = "fp8-e4m3,nvfp4"
"""Codecs the compressed all-reduce part compares with FP32."""

_MODULES = {"allreduce": "commwire.bench.allreduce", "glm": "commwire.bench.glm", "torch": "commwire.bench.torch_ddp"}
# Per benchmark and variant: (arguments of a full run, arguments of a --quick run).
_ARGS: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {
    ("allreduce", "fp32"): ((), ("--sizes", "64K,1M", "--repeats", "2")),
    ("allreduce", "codecs"): (("--codec", CODECS), ("--codec", CODECS, "--sizes", "64K,1M", "--repeats", "2")),
    ("glm", ""): ((), ("--scale", "0.05", "--steps", "256", "--sweep", "", "--repeats", "1")),
    ("torch", ""): ((), ("--steps", "3", "--rounds", "2")),
}
_VARIANTS = {"allreduce": ("fp32", "codecs"), "glm": ("",), "torch": ("",)}
_STDERR_LINES = 30


# --------------------------------------------------------------------------- configuration


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_only(text: str) -> tuple[str, ...]:
    """Return the benchmark names of an ``--only`` value, refusing unknown ones."""
    names = _split(text)
    bad = [name for name in names if name not in BENCHES]
    if bad:
        raise ValueError(f"--only: unknown benchmark {', '.join(map(repr, bad))}; choose from "
                         f"{','.join(BENCHES)} (e.g. --only allreduce,glm)")
    if not names:
        raise ValueError(f"--only {text!r} names no benchmark; choose from {','.join(BENCHES)} "
                         "(e.g. --only allreduce,glm)")
    return tuple(dict.fromkeys(names))


def parse_lab(text: str) -> tuple[str, ...]:
    """Return the normalised bandwidths of a ``--lab`` value ('10gbit,1gbit'), refusing bad ones."""
    from ..lab.bandwidth import format_bandwidth, parse_bandwidth

    out = []
    for item in _split(text):
        try:
            out.append(format_bandwidth(parse_bandwidth(item)))
        except ValueError as exc:
            raise ValueError(f"--lab: {exc}") from None
    return tuple(dict.fromkeys(out))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SuiteConfig:
    """What ``commwire bench suite`` runs and where it writes the report."""

    out: Path
    """Report folder: suite.json, suite.md, PNGs and parts/ (each part's JSON rows and log)."""
    np: int = 4
    """Ranks of every part."""
    quick: bool = False
    """Tiny sizes and steps: the loopback parts finish in a minute or two."""
    lab: tuple[str, ...] = ()
    """Bandwidths ('1gbit') to bring a lab of LAB_HOSTS hosts up at, one after the other."""
    only: tuple[str, ...] = BENCHES
    """Benchmarks to run (a subset of BENCHES)."""
    quiet: bool = False
    """Do not stream the parts' output, only the progress."""

    def __post_init__(self) -> None:
        if isinstance(self.np, bool) or not isinstance(self.np, int) or self.np < 1:
            raise ValueError(f"--np must be a whole number of ranks >= 1, got {self.np!r} (e.g. --np 4)")
        # Normalised here too, so that the API refuses what the command line refuses.
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "only", parse_only(",".join(self.only)))
        object.__setattr__(self, "lab", parse_lab(",".join(self.lab)))
        if not plan(self):
            lab_only = [name for name in self.only if name not in LOOPBACK_BENCHES]
            raise ValueError(f"--only {','.join(self.only)} selects no part: {', '.join(lab_only)} "
                             f"run{'s' if len(lab_only) == 1 else ''} only on the lab; add --lab 1gbit, "
                             f"or include {' or '.join(LOOPBACK_BENCHES)}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Part:
    """One benchmark job of the suite."""

    bench: str
    """Benchmark name (one of BENCHES)."""
    variant: str
    """'fp32' or 'codecs' for allreduce, '' otherwise."""
    bandwidth: str | None
    """Lab bandwidth, or None for loopback."""
    args: tuple[str, ...]
    """Arguments to the benchmark module (without --json)."""

    @property
    def name(self) -> str:
        """Return the part's name, e.g. 'allreduce codecs'."""
        return f"{self.bench} {self.variant}".strip()

    @property
    def where(self) -> str:
        """Return 'loopback' or 'lab 1gbit'."""
        return "loopback" if self.bandwidth is None else f"lab {self.bandwidth}"

    @property
    def module(self) -> str:
        """Return the benchmark's module."""
        return _MODULES[self.bench]

    def slug(self, index: int) -> str:
        """Return a file-name stem unique within the suite."""
        return re.sub(r"[^a-z0-9]+", "-", f"{index:02d} {self.name} {self.where}".lower()).strip("-")


def plan(config: SuiteConfig) -> list[Part]:
    """Return the suite's parts in the order they run: loopback first, then each lab bandwidth."""
    places: list[tuple[str | None, tuple[str, ...]]] = [(None, LOOPBACK_BENCHES)]
    places += [(bw, LAB_BENCHES) for bw in config.lab]
    return [Part(bench=bench, variant=variant, bandwidth=bw, args=_ARGS[bench, variant][int(config.quick)])
            for bw, benches in places for bench in benches if bench in config.only
            for variant in _VARIANTS[bench]]


def part_argv(part: Part, np: int, json_path: Path | str) -> list[str]:
    """Return the ``commwire run`` command line of *part* writing its rows to *json_path*."""
    lab = ["--lab"] if part.bandwidth is not None else []
    return [sys.executable, "-m", "commwire", "run", "-np", str(np), *lab,
            sys.executable, "-m", part.module, "--json", str(json_path), *part.args]


# --------------------------------------------------------------------------- results
@dataclasses.dataclass(kw_only=True, slots=True)
class PartResult:
    """What one part produced: its rows, or how it failed."""

    bench: str
    name: str
    where: str
    argv: list[str]
    rc: int | None
    """Exit status of the job; None when it never started (e.g. the lab did not come up)."""
    wall_s: float
    rows: list[dict[str, Any]]
    stderr_tail: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None
    """Why the part failed, in words (None when it succeeded)."""
    log: str | None = None
    """The part's full output, relative to the report folder."""

    @property
    def ok(self) -> bool:
        """Return whether the part ran, exited 0 and wrote rows."""
        return self.rc == 0 and self.error is None

    def to_json(self) -> dict[str, Any]:
        """Return the part's entry of suite.json."""
        return dataclasses.asdict(self)

    @classmethod
    def not_run(cls, part: Part, argv: list[str], error: str) -> PartResult:
        """Return the result of a part that could not start."""
        return cls(bench=part.bench, name=part.name, where=part.where, argv=argv, rc=None, wall_s=0.0, rows=[],
                   error=error)


# --------------------------------------------------------------------------- progress


class Progress(Steps):
    """The suite's progress (``Steps``, drawn with rich on a terminal), told in parts and their results."""

    def __init__(self, total: int, *, quiet: bool = False, out: TextIO | None = None, err: TextIO | None = None,
                 tty: bool | None = None) -> None:
        super().__init__(total, "suite", quiet=quiet, out=out, err=err, tty=tty)

    def start(self, index: int, part: Part) -> None:  # type: ignore[override]
        """Announce that part number *index* (0-based) starts."""
        super().start(index, f"{part.name} @ {part.where}")

    def finish(self, index: int, result: PartResult) -> None:  # type: ignore[override]
        """Announce how part number *index* ended."""
        if result.ok:
            how = f"ok in {result.wall_s:.1f} s, {len(result.rows)} rows"
        else:
            status = "not run" if result.rc is None else f"FAILED (exit {result.rc})"
            how = f"{status} after {result.wall_s:.1f} s: {result.error}"
        super().finish(index, f"{result.name} @ {result.where}: {how}")
        if not result.ok and self.quiet and result.stderr_tail:
            for line in result.stderr_tail[-5:]:
                self._print(f"  {line}", self.err)


# --------------------------------------------------------------------------- running


def _pump(stream: TextIO, sink: Callable[[str], None]) -> None:
    for raw in stream:
        sink(raw.rstrip("\n"))


def _stop(proc: subprocess.Popen[str]) -> None:
    """End *proc* (`commwire run` forwards SIGTERM to its ranks and leaves no orphan)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _load_rows(path: Path) -> list[dict[str, Any]] | None:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    return rows if isinstance(rows, list) else None


def run_part(part: Part, index: int, config: SuiteConfig, progress: Progress) -> PartResult:
    """Run *part* as a ``commwire run`` job, streaming its output; return its rows or its failure."""
    parts_dir = config.out / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    json_path, log_path = parts_dir / f"{part.slug(index)}.json", parts_dir / f"{part.slug(index)}.log"
    json_path.unlink(missing_ok=True)
    argv = part_argv(part, config.np, json_path)
    label = f"{part.name} @ {part.where}"
    tail: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {display_argv(argv)}\n")
        lock = threading.Lock()

        def sink(stderr: bool) -> Callable[[str], None]:
            def write(text: str) -> None:
                with lock:
                    log.write(("stderr: " if stderr else "") + text + "\n")
                    if stderr:
                        tail.append(text)
                progress.line(label, text, stderr=stderr)
            return write

        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, errors="replace")
        except OSError as exc:
            return PartResult.not_run(part, argv, f"could not start {argv[0]}: {exc}")
        readers = [threading.Thread(target=_pump, args=(s, sink(e)), daemon=True)
                   for s, e in ((proc.stdout, False), (proc.stderr, True))]
        for reader in readers:
            reader.start()
        try:
            rc = proc.wait()
        except BaseException:
            _stop(proc)
            raise
        finally:
            for reader in readers:
                reader.join(timeout=5)
    rows = _load_rows(json_path)
    error = None
    if rc != 0:
        error = tail[-1] if tail else f"exit status {rc}, no output on stderr"
    elif rows is None:
        error = f"the benchmark exited 0 but wrote no rows to {json_path}"
    return PartResult(bench=part.bench, name=part.name, where=part.where, argv=argv, rc=rc,
                      wall_s=time.monotonic() - start, rows=rows or [], stderr_tail=list(tail), error=error,
                      log=str(log_path.relative_to(config.out)))


def _preflight(config: SuiteConfig) -> None:
    """Refuse before running anything when the lab parts cannot run (not root, no ip/tc, another lab up)."""
    if not config.lab:
        return
    from .. import lab
    from ..lab.bandwidth import parse_bandwidth

    lab.require_tools()  # PermissionError / RuntimeError that say what to do
    running = lab.status()
    if running is None:
        return
    wanted = [(LAB_HOSTS, parse_bandwidth(bw)) for bw in config.lab]
    if wanted != [running.settings()]:
        raise RuntimeError(
            f"a lab is already up with {running.hosts} hosts at {running.bandwidth}, and the suite does not "
            f"change a lab it did not start; it needs {LAB_HOSTS} hosts at {', '.join(config.lab)}: run "
            f"`commwire lab down` first"
            + (f", or pass --lab {running.bandwidth} to use the running lab" if running.hosts == LAB_HOSTS else "")
        )


@contextlib.contextmanager
def _lab_session(bandwidth: str, progress: Progress) -> Iterator[None]:
    """Bring a lab of LAB_HOSTS hosts up at *bandwidth* and take it down afterwards (in a finally).

    A lab that is already up with exactly these settings is used as it is and left up:
    the suite only removes what it created.
    """
    from .. import lab
    from ..lab.bandwidth import parse_bandwidth

    running = lab.status()
    created = running is None
    if running is not None and running.settings() != (LAB_HOSTS, parse_bandwidth(bandwidth)):
        raise RuntimeError(f"a lab is already up with {running.hosts} hosts at {running.bandwidth}; "
                           f"run `commwire lab down` first")
    if created:
        progress.note(f"lab up: {LAB_HOSTS} hosts at {bandwidth}")
        lab.up(hosts=LAB_HOSTS, bandwidth=bandwidth)
    else:
        progress.note(f"using the running lab ({LAB_HOSTS} hosts at {bandwidth}); it stays up afterwards")
    try:
        yield
    finally:
        if created:
            progress.note(f"lab down ({bandwidth})")
            try:
                lab.down()
            except (RuntimeError, PermissionError, OSError) as exc:
                # Warn, never raise: an error here would hide a Ctrl-C or let the suite go on.
                progress.note(f"warning: the lab did not come down: {exc}; run `commwire lab down`")


def _run_parts(parts: list[tuple[int, Part]], config: SuiteConfig, progress: Progress,
               results: list[PartResult]) -> None:
    """Run *parts* one after the other, appending their results (popped from *parts* as they finish)."""
    while parts:
        index, part = parts[0]
        progress.start(index, part)
        results.append(run_part(part, index, config, progress))
        parts.pop(0)
        progress.finish(index, results[-1])


def _run_group(parts: list[tuple[int, Part]], config: SuiteConfig, progress: Progress,
               results: list[PartResult]) -> None:
    """Run the parts of one place (loopback, or one lab bandwidth), appending their results."""
    bandwidth = parts[0][1].bandwidth
    pending = list(parts)
    if bandwidth is None:
        _run_parts(pending, config, progress, results)
        return
    try:
        with _lab_session(bandwidth, progress):
            _run_parts(pending, config, progress, results)
    except (RuntimeError, ValueError, PermissionError, FileNotFoundError) as exc:
        # The lab did not come up: record its parts as not run and carry on with the next place.
        for index, part in pending:
            progress.start(index, part)
            results.append(PartResult.not_run(part, part_argv(part, config.np, "-"), f"lab {bandwidth}: {exc}"))
            progress.finish(index, results[-1])


def _meta(argv: Sequence[str]) -> dict[str, Any]:
    """Return what the report says about the run: command, date, host, versions, git commit."""
    versions = {}
    for dist in ("commwire", "numpy", "mpi4py", "mpich", "torch", "matplotlib"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        from ..launch import find_launcher

        launcher = find_launcher()
        launcher_text = f"{launcher.kind} ({launcher.path})"
    except (RuntimeError, ValueError) as exc:
        launcher_text = f"none: {exc}"
    return {
        "command": shlex.join(["commwire", "bench", "suite", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {
            "hostname": platform.node(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "launcher": launcher_text,
            "versions": versions,
        },
        "git": _git(),
    }


def _git() -> dict[str, Any] | None:
    """Return the commit of the source tree commwire runs from (None outside a git checkout)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    # GIT_OPTIONAL_LOCKS=0: `git status` must not refresh (write) the index.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, env=env)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}


@dataclasses.dataclass(kw_only=True, slots=True)
class SuiteOutcome:
    """What `run_suite` ran and wrote."""

    meta: dict[str, Any]
    results: list[PartResult]
    files: dict[str, Any]
    """`write_report`'s answer: paths of suite.json and suite.md, PNG names (None: matplotlib missing)."""

    @property
    def failed(self) -> list[PartResult]:
        """Return the parts that did not succeed."""
        return [r for r in self.results if not r.ok]


def run_suite(config: SuiteConfig, argv: Sequence[str] = (), *, progress: Progress | None = None) -> SuiteOutcome:
    """Run every part of *config* and write the report into ``config.out``.

    suite.json is rewritten after every place (loopback, each lab), so an interrupted
    suite keeps what it measured; suite.md and the plots are written at the end, also
    after Ctrl-C (the KeyboardInterrupt is re-raised). Raises PermissionError or
    RuntimeError before running anything when the lab parts cannot run.
    """
    _preflight(config)
    config.out.mkdir(parents=True, exist_ok=True)
    meta = _meta(argv)
    parts = plan(config)
    progress = progress or Progress(len(parts), quiet=config.quiet)
    results: list[PartResult] = []
    groups: dict[str | None, list[tuple[int, Part]]] = {}
    for index, part in enumerate(parts):
        groups.setdefault(part.bandwidth, []).append((index, part))
    start = time.monotonic()
    try:
        with signals_raise():
            for group in groups.values():
                _run_group(group, config, progress, results)
                write_json(config.out, meta, results)
    except KeyboardInterrupt:
        meta["interrupted"] = True
        raise
    finally:
        progress.close()
        meta["wall_s"] = time.monotonic() - start
        files = write_report(config.out, meta, results)
    return SuiteOutcome(meta=meta, results=results, files=files)


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench suite``."""
    parser = argparse.ArgumentParser(prog="commwire bench suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="reports/suite", help="report folder (default reports/suite)")
    parser.add_argument("--np", type=int, default=4, help="ranks of every part (default 4)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and steps (a minute or two on loopback)")
    parser.add_argument("--lab", default="", help="also run on a lab of 4 hosts at each bandwidth, e.g. 10gbit,1gbit "
                                                  "(needs root, ip and tc)")
    parser.add_argument("--only", default=",".join(BENCHES), help=f"benchmarks to run (default {','.join(BENCHES)})")
    parser.add_argument("--quiet", action="store_true", help="do not stream the parts' output")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the suite, write the report; return 1 if any part failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = SuiteConfig(out=Path(args.out), np=args.np, quick=args.quick, lab=(args.lab,), only=(args.only,),
                             quiet=args.quiet)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        outcome = run_suite(config, argv)
    except (PermissionError, RuntimeError) as exc:
        print(f"commwire bench suite: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"commwire bench suite: interrupted; what finished is in {config.out / 'suite.md'}", file=sys.stderr)
        return 130
    if outcome.files["plots"] is None:
        print(f"commwire bench suite: {PLOTS_MISSING}", file=sys.stderr)
    n, bad = len(outcome.results), len(outcome.failed)
    print(f"report: {outcome.files['markdown']} ({n - bad}/{n} parts ok, {outcome.meta['wall_s']:.0f} s)"
          + (f"; failed: {', '.join(f'{r.name} @ {r.where}' for r in outcome.failed)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
