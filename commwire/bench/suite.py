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
import math
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
_PLOTS_MISSING = "plots skipped: matplotlib is not installed (pip install 'commwire[bench]')"


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


def _display(argv: Sequence[str]) -> str:
    """Return *argv* as a user would type it: `commwire run ... python -m ...`."""
    words = list(argv)
    if words[1:3] == ["-m", "commwire"]:
        words = ["commwire", *words[3:]]
    return shlex.join("python" if w == sys.executable else w for w in words)


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
        log.write(f"$ {_display(argv)}\n")
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
                _write_json(config.out, meta, results)
    except KeyboardInterrupt:
        meta["interrupted"] = True
        raise
    finally:
        progress.close()
        meta["wall_s"] = time.monotonic() - start
        files = write_report(config.out, meta, results)
    return SuiteOutcome(meta=meta, results=results, files=files)


# --------------------------------------------------------------------------- headline


def _x(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}×"


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def _headline_allreduce(r: PartResult) -> list[dict[str, Any]]:
    out = []
    plain = [row for row in r.rows if row.get("codec") is None]
    if plain:
        top = max(plain, key=lambda row: row["bytes"])
        out.append({"measure": f"commwire FP32 all-reduce time at {_size(top['bytes'])} (lower is better)",
                    "ratio": top["ratio"], "baseline": "mpi4py Allreduce",
                    "note": f"{top['commwire_us']:.1f} µs vs {top['raw_us']:.1f} µs"})
    for codec in dict.fromkeys(row["codec"] for row in r.rows if row.get("codec") is not None):
        top = max((row for row in r.rows if row.get("codec") == codec), key=lambda row: row["bytes"])
        out.append({"measure": f"{codec} speed-up at {_size(top['bytes'])} (higher is better)",
                    "ratio": top["raw_us"] / top["commwire_us"], "baseline": "FP32 MPI_Allreduce",
                    "note": f"{top['commwire_us'] / 1e3:.2f} ms vs {top['raw_us'] / 1e3:.2f} ms, "
                            f"rel. L2 error {top.get('rel_l2_err', float('nan')):.4f}"})
    return out


def _headline_glm(r: PartResult) -> list[dict[str, Any]]:
    rows = [row for row in r.rows if row.get("table") == "headline" and row.get("solver") == "casgd"
            and row.get("precision") == "mixed"]
    return [{"measure": f"CA-SGD mixed (s={row['s']}, b={row['b']}) speed-up, {row['dataset']} (higher is better)",
             "ratio": row["speedup_vs_sgd_fp32"], "baseline": "FP32 SGD, same batches",
             "note": f"loss gap {100 * row['loss_gap_vs_sgd_fp32']:+.3f}%"} for row in rows]


def _headline_torch(r: PartResult) -> list[dict[str, Any]]:
    if not r.rows:
        return []
    ddp = r.rows[0]
    return [{"measure": f"{row['config']} step time (lower is better)", "ratio": row["ratio_vs_ddp"],
             "baseline": ddp["config"], "note": f"{row['step_ms']:.1f} ms vs {ddp['step_ms']:.1f} ms"}
            for row in r.rows[1:]]


_HEADLINES = {"allreduce": _headline_allreduce, "glm": _headline_glm, "torch": _headline_torch}


def headline(results: Sequence[PartResult]) -> list[dict[str, Any]]:
    """Return the key ratio(s) of every part: one dict per (part, where, measure)."""
    out = []
    for r in results:
        base = {"part": r.name, "where": r.where}
        if not r.ok:
            status = "not run" if r.rc is None else f"failed (exit {r.rc})"
            out.append({**base, "measure": status, "ratio": None, "baseline": "", "note": r.error or ""})
            continue
        try:
            out += [{**base, **row} for row in _HEADLINES[r.bench](r)]
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            out.append({**base, "measure": "rows not understood", "ratio": None, "baseline": "",
                        "note": f"{type(exc).__name__}: {exc}"})
    return out


# --------------------------------------------------------------------------- Markdown


def _cell(value: Any, fmt: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    text = format(value, fmt) if fmt else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _get(key: str, fmt: str = "", scale: float = 1.0) -> Callable[[dict[str, Any]], str]:
    def get(row: dict[str, Any]) -> str:
        value = row.get(key)
        return _cell(value * scale if isinstance(value, (int, float)) and not isinstance(value, bool)
                     and scale != 1.0 else value, fmt)
    return get


def _ratio(num: str, den: str) -> Callable[[dict[str, Any]], str]:
    def get(row: dict[str, Any]) -> str:
        try:
            return _x(row[num] / row[den])
        except (KeyError, TypeError, ZeroDivisionError):
            return "-"
    return get


def _pct(key: str) -> Callable[[dict[str, Any]], str]:
    def get(row: dict[str, Any]) -> str:
        value = row.get(key)
        return "-" if not isinstance(value, (int, float)) or not math.isfinite(value) else f"{100 * value:+.3f}%"
    return get


Columns = list[tuple[str, Callable[[dict[str, Any]], str]]]
# Ratio columns (bold headers) come right after the columns that say what a row is.
_COLUMNS: dict[str, Columns] = {
    "allreduce fp32": [
        ("size", lambda r: _size(r["bytes"])), ("ranks", _get("ranks")),
        ("**commwire / mpi4py time**", lambda r: _x(r.get("ratio"))),
        ("mpi4py µs", _get("raw_us", ".1f")), ("commwire µs", _get("commwire_us", ".1f")),
        ("mpi4py GB/s", _get("raw_GBps", ".3f")), ("commwire GB/s", _get("commwire_GBps", ".3f"))],
    "allreduce codecs": [
        ("size", lambda r: _size(r["bytes"])), ("codec", _get("codec")), ("ranks", _get("ranks")),
        ("**speed-up vs FP32 MPI**", _ratio("raw_us", "commwire_us")),
        ("FP32 MPI ms", _get("raw_us", ".2f", 1e-3)), ("compressed ms", _get("commwire_us", ".2f", 1e-3)),
        ("encode ms", _get("encode_us", ".2f", 1e-3)), ("transfer ms", _get("transfer_us", ".2f", 1e-3)),
        ("decode ms", _get("decode_us", ".2f", 1e-3)), ("wire B/elem", _get("wire_bytes_per_elem", ".4f")),
        ("rel. L2 error", _get("rel_l2_err", ".4f"))],
    "glm": [
        ("table", _get("table")), ("data set", _get("dataset")), ("solver", _get("solver")),
        ("precision", _get("precision")), ("s", _get("s")), ("b", _get("b")), ("steps", _get("steps")),
        ("**speed-up vs FP32 SGD**", lambda r: _x(r.get("speedup_vs_sgd_fp32"))),
        ("**best-of speed-up**", lambda r: _x(r.get("best_speedup_vs_sgd_fp32"))),
        ("**loss gap**", _pct("loss_gap_vs_sgd_fp32")),
        ("wall s", _get("wall_s", ".3f")), ("µs/step", _get("us_per_step", ".1f")),
        ("allreduces", _get("allreduces")), ("ranks", _get("ranks"))],
    "torch": [
        ("config", _get("config")), ("ranks", _get("ranks")),
        ("**step time vs DDP**", lambda r: _x(r.get("ratio_vs_ddp"))),
        ("median step ms", _get("step_ms", ".1f")), ("wire MB/step", _get("wire_MB_per_step", ".2f")),
        ("collectives/step", _get("collectives_per_step", ".1f")), ("hidden comm", _get("hidden_fraction", ".0%")),
        ("tensors", _get("tensors"))],
}


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(b) + " |" for b in body]


def _rows_table(result: PartResult) -> list[str]:
    columns = _COLUMNS.get(result.name) or _COLUMNS.get(result.bench)
    if columns is None:
        keys = list(dict.fromkeys(k for row in result.rows for k in row))
        columns = [(k, _get(k)) for k in keys]
    body = []
    for row in result.rows:
        cells = []
        for _, get in columns:
            try:
                cells.append(get(row))
            except (KeyError, TypeError, ValueError):
                cells.append("-")
        body.append(cells)
    return _table([h for h, _ in columns], body)


def _headline_md(rows: list[dict[str, Any]]) -> list[str]:
    body = [[_cell(r["part"]), _cell(r["where"]), _cell(r["measure"]), f"**{_x(r['ratio'])}**"
             if r["ratio"] is not None else "-", _cell(r["baseline"]), _cell(r["note"])] for r in rows]
    return _table(["part", "where", "measure", "ratio", "baseline (same job)", "note"], body)


def _part_md(result: PartResult) -> list[str]:
    status = "not run" if result.rc is None else f"exit {result.rc}"
    lines = ["", f"## {result.name} — {result.where}", "",
             f"`{_display(result.argv)}` · {status} · {result.wall_s:.1f} s · {len(result.rows)} rows"
             + (f" · log: [{result.log}]({result.log})" if result.log else "")]
    if not result.ok:
        lines += ["", f"**Failed:** {_cell(result.error)}"]
        if result.stderr_tail:
            lines += ["", "```", *result.stderr_tail[-15:], "```"]
    if result.rows:
        lines += [""] + _rows_table(result)
    return lines


def _markdown(meta: dict[str, Any], results: Sequence[PartResult], plots: list[str] | None,
              heads: list[dict[str, Any]]) -> str:
    host = meta.get("host", {})
    git = meta.get("git") or {}
    commit = git.get("commit", "unknown")[:12] + (" (uncommitted changes)" if git.get("dirty") else "")
    load = host.get("load_average_at_start")
    failed = [r for r in results if not r.ok]
    lines = ["# commwire benchmark suite", "", f"Command: `{meta.get('command', '')}`", "",
             f"Date: {meta.get('date', '')} · host: {host.get('hostname', '?')} ({host.get('platform', '?')}, "
             f"{host.get('cpus', '?')} CPUs"
             + (f", load average {load[0]:.2f} at start" if load else "") + f") · commit: {commit}"
             + (f" · total {meta['wall_s']:.0f} s" if "wall_s" in meta else ""), "",
             "Every figure is a ratio against a baseline measured in the same job (bold columns); "
             "absolute times depend on the machine and on what else ran on it.", ""]
    if meta.get("interrupted"):
        lines += ["**Interrupted:** the suite was stopped before every part ran; this report has what finished.", ""]
    lines += [f"{len(results) - len(failed)} of {len(results)} parts succeeded"
              + (f"; failed: {', '.join(f'{r.name} @ {r.where}' for r in failed)}." if failed else "."), "",
              "## Headline", ""] + _headline_md(heads)
    lines += ["", "## Plots", ""]
    if plots is None:
        lines.append(f"({_PLOTS_MISSING}.)")
    elif not plots:
        lines.append("(no rows to plot.)")
    else:
        for name in plots:
            lines += [f"![{Path(name).stem}]({name})", ""]
    for result in results:
        lines += _part_md(result)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots


def _series_style(wheres: list[str]) -> dict[str, dict[str, Any]]:
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    return {w: {"linestyle": styles[i % len(styles)][0], "marker": styles[i % len(styles)][1]}
            for i, w in enumerate(wheres)}


def _allreduce_series(results: Sequence[PartResult]) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    """Return (series, where) -> [(bytes, time_us, speed-up vs its baseline)] for the allreduce parts."""
    series: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    plain_where = {r.where for r in results if r.name == "allreduce fp32" and r.rows}
    for r in results:
        if r.bench != "allreduce":
            continue
        for row in r.rows:
            codec = row.get("codec")
            if codec is None:
                series.setdefault(("mpi4py FP32", r.where), []).append((row["bytes"], row["raw_us"], 1.0))
                series.setdefault(("commwire FP32", r.where), []).append(
                    (row["bytes"], row["commwire_us"], row["raw_us"] / row["commwire_us"]))
            else:
                series.setdefault((codec, r.where), []).append(
                    (row["bytes"], row["commwire_us"], row["raw_us"] / row["commwire_us"]))
                if r.where not in plain_where:  # the codec part's own FP32 baseline
                    series.setdefault(("FP32 MPI", r.where), []).append((row["bytes"], row["raw_us"], 1.0))
    return {key: sorted(dict((b, (b, t, s)) for b, t, s in pts).values()) for key, pts in series.items()}


def _plot_allreduce(plt: Any, results: Sequence[PartResult], out: Path) -> list[str]:
    series = _allreduce_series(results)
    if not series:
        return []
    wheres = list(dict.fromkeys(w for _, w in series))
    names = list(dict.fromkeys(n for n, _ in series))
    style = _series_style(wheres)
    colors = {n: f"C{i}" for i, n in enumerate(names)}
    files = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, where), pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[name], label=f"{name} · {where}",
                **style[where])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time per all-reduce (µs, median)")
    ax.set_title("all-reduce time vs size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    files.append(_save(plt, fig, out, "allreduce_time.png"))
    compressed = {k: v for k, v in series.items() if k[0] not in ("mpi4py FP32", "FP32 MPI", "commwire FP32")}
    if compressed:
        fig, ax = plt.subplots(figsize=(8, 5))
        for (name, where), pts in compressed.items():
            ax.plot([p[0] for p in pts], [p[2] for p in pts], color=colors[name], label=f"{name} · {where}",
                    **style[where])
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("speed-up over FP32 MPI_Allreduce (same job)")
        ax.set_title("compressed all-reduce speed-up vs size (> 1: faster)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        files.append(_save(plt, fig, out, "allreduce_speedup.png"))
    return files


def _bars(plt: Any, groups: list[str], bars: dict[str, dict[str, float]], *, ylabel: str, title: str,
          out: Path, name: str) -> str:
    """Draw grouped bars: one group per *groups* entry, one bar per key of *bars*; a line at 1."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(bars)) ** 0.5 + 3), 4.8))
    width = 0.8 / max(len(bars), 1)
    x = np.arange(len(groups))
    for i, (label, values) in enumerate(bars.items()):
        ax.bar(x + i * width, [values.get(g, float("nan")) for g in groups], width, label=label)
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.set_xticks(x + width * (len(bars) - 1) / 2, groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(plt, fig, out, name)


def _plot_glm(plt: Any, results: Sequence[PartResult], out: Path) -> list[str]:
    bars: dict[str, dict[str, float]] = {}
    groups: list[str] = []
    for r in results:
        if r.bench != "glm":
            continue
        for row in r.rows:
            if row.get("table") != "headline" or (row["solver"], row["precision"]) == ("sgd", "fp32"):
                continue
            group = f"{row['dataset']}\n{r.where}"
            groups.append(group)
            label = f"{row['solver']} {row['precision']}" + (f" s={row['s']}" if row["solver"] == "casgd" else "")
            bars.setdefault(label, {})[group] = row["speedup_vs_sgd_fp32"]
    if not bars:
        return []
    return [_bars(plt, list(dict.fromkeys(groups)), bars, ylabel="speed-up vs FP32 SGD (same job)",
                  title="GLM: speed-up over FP32 SGD per data set (> 1: faster)", out=out, name="glm_speedup.png")]


def _plot_torch(plt: Any, results: Sequence[PartResult], out: Path) -> list[str]:
    bars: dict[str, dict[str, float]] = {}
    groups: list[str] = []
    for r in results:
        if r.bench != "torch":
            continue
        for row in r.rows:
            groups.append(row["config"])
            bars.setdefault(r.where, {})[row["config"]] = row["ratio_vs_ddp"]
    if not bars:
        return []
    return [_bars(plt, list(dict.fromkeys(groups)), bars, ylabel="step time / DDP step time (same job)",
                  title="torch: step time vs DDP over gloo (< 1: faster)", out=out,
                  name="torch_step.png")]


def _save(plt: Any, fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _plots(results: Sequence[PartResult], out: Path) -> list[str] | None:
    """Draw the PNGs into *out*; return their names, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    files = []
    for draw in (_plot_allreduce, _plot_glm, _plot_torch):
        try:
            files += draw(plt, results, out)
        except Exception as exc:  # noqa: BLE001 - a plot must never cost the JSON and Markdown
            print(f"commwire bench suite: warning: {draw.__name__[6:]} plot failed: {exc!r}", file=sys.stderr)
            plt.close("all")
    return files


# --------------------------------------------------------------------------- report


def _write_json(out: Path, meta: dict[str, Any], results: Sequence[PartResult],
                heads: list[dict[str, Any]] | None = None) -> Path:
    path = out / "suite.json"
    data = {"meta": meta, "parts": [r.to_json() for r in results],
            "headline": heads if heads is not None else headline(results)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_report(out: Path | str, meta: dict[str, Any], results: Sequence[PartResult]) -> dict[str, Any]:
    """Write suite.json, suite.md and the PNGs into *out*; return {'json', 'markdown', 'plots'}.

    'plots' is the list of PNG names, or None when matplotlib is not installed (the
    JSON and Markdown are written all the same, and the Markdown says so).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    heads = headline(results)
    json_path = _write_json(out, meta, results, heads)
    plots = _plots(results, out)
    md_path = out / "suite.md"
    md_path.write_text(_markdown(meta, results, plots, heads), encoding="utf-8")
    return {"json": json_path, "markdown": md_path, "plots": plots}


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
        print(f"commwire bench suite: {_PLOTS_MISSING}", file=sys.stderr)
    n, bad = len(outcome.results), len(outcome.failed)
    print(f"report: {outcome.files['markdown']} ({n - bad}/{n} parts ok, {outcome.meta['wall_s']:.0f} s)"
          + (f"; failed: {', '.join(f'{r.name} @ {r.where}' for r in outcome.failed)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
