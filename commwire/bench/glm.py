"""Benchmark GLM SGD against CA-SGD (s-step Gram exchange) on synthetic dense sets.

Every configuration runs the same inner steps on the same batches; rows report
the training-loop wall time (slowest rank, median of repeats), the allreduce
count and bytes this rank handed to MPI, the final objective (mean loss +
l2/2 ||w||^2, float64 over all rows) and, against FP32 SGD with the same batch
size and steps, the speed-up and the relative loss gap. The sweep over s and b
is reported in full, including the configurations where CA-SGD loses.

The ``auto`` table runs every configuration to convergence under ``tol`` instead
(the same tol, epochs cap and seed for all): FP32 SGD and mixed CA-SGD at each
fixed s and at s="auto" (s chosen at fit time from the measured link and Gram
cost), per batch size. Its speed-up is per inner step (µs/step of the run to
convergence, the tuning time of "auto" included), as runs stop after different
epochs; the time to tol and its ratio are shown too, and the loss gap is at
convergence. A summary puts "auto" next to the best fixed s of each batch size.

The benchmark uses whatever MPI world it is launched in, so the same command
measures shared memory on one host (``mpiexec -n 4``) and TCP between hosts
(the ``commwire lab`` namespaces). The header line gives the measured latency
of a 16-float allreduce, which tells the two regimes apart. Each row also gives
the loop's compute alone (every rank in turn runs it on its own block with no
communication while the others sleep): ``python benchmarks/calibrate.py --glm`` models
the step time from it.

Run: ``commwire bench glm -np 4`` or ``mpiexec -n 4 python -m commwire.bench.glm``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import Any

import numpy as np

from ._report import emit

__all__ = ["NAME", "HELP", "DRIVER", "DATASETS", "run_glm_bench", "format_table", "summarize_auto", "build_parser",
           "check_args", "main"]

NAME = "glm"
HELP = 'GLM SGD vs CA-SGD (s-step Gram exchange), fixed s and s="auto"'
DRIVER = False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BenchSet:
    """Describe one synthetic dense data set shaped like the paper's."""

    loss: str
    m: int
    n: int
    lr: float
    l2: float
    note: str


DATASETS: dict[str, BenchSet] = {
    "epsilon-like": BenchSet(loss="logistic", m=100_000, n=2000, lr=2.0, l2=1e-4,
                             note="100k x 2000 dense logistic, unit-scale rows (like epsilon)"),
    "susy-like": BenchSet(loss="logistic", m=1_000_000, n=28, lr=1.0, l2=1e-4,
                          note="1M x 28 dense logistic (like SUSY/HIGGS)"),
    "poisson": BenchSet(loss="poisson", m=500_000, n=64, lr=0.2, l2=1e-4,
                        note="500k x 64 dense Poisson, log link"),
    "logistic-20k": BenchSet(loss="logistic", m=20_000, n=512, lr=1.0, l2=1e-4,
                             note="20k x 512 dense logistic: the s='auto' comparison"),
}


def _blocks(name: str, comm: Any, seed: int, scale: float) -> Any:
    """Generate this rank's column block and the shared labels of a data set (no file I/O)."""
    from ..glm import ColumnBlocks, column_ranges, margins

    spec = DATASETS[name]
    m = max(1, int(spec.m * scale))
    lo, hi = column_ranges(spec.n, comm.size)[comm.rank]
    rng = np.random.default_rng([seed, lo])
    # Entries of variance 1/n: rows of unit expected norm, so one lr fits every n.
    X = rng.standard_normal((m, hi - lo), dtype=np.float32) / np.float32(math.sqrt(spec.n))
    w_true = rng.standard_normal(hi - lo)
    blocks = ColumnBlocks(X=X, y=np.zeros(m), start=lo, n_features=spec.n)
    z, _ = margins(blocks, w_true, comm=comm)
    z = (z - z.mean()) / max(z.std(), 1e-12)
    shared = np.random.default_rng([seed, spec.n, m])  # the same draws on every rank
    if spec.loss == "logistic":
        y = (2.0 * z + shared.standard_normal(m) > 0).astype(np.float64)
    else:
        y = shared.poisson(np.exp(0.5 * z + 1.0)).astype(np.float64)
    return ColumnBlocks(X=X, y=y, start=lo, n_features=spec.n)


def _latency_us(comm: Any, iters: int = 500) -> float:
    """Return the median time of a 16-float allreduce through the Communicator (slowest rank)."""
    x = np.ones(16, dtype=np.float32)
    for _ in range(20):
        comm.allreduce(x, out=x)
    samples = []
    for _ in range(5):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            comm.allreduce(x, out=x)
        samples.append(comm.mpi.allreduce((time.perf_counter() - start) / iters, op=_max()))
    return float(np.median(samples)) * 1e6


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def _turn_wait(comm: Any) -> None:
    """Wait for the other ranks without spinning (a sleeping poll), so a rank timing alone has its core."""
    req = comm.mpi.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def _compute_alone(blocks: Any, configs: list[Any], comm: Any, repeats: int) -> list[float]:
    """Return each configuration's training-loop time with no communication (slowest rank's block).

    Each rank in turn runs the solver on its own column block over a one-rank
    communicator while the others sleep, so the time is this block's compute and the
    solver's own overhead, unshared: the cost model's per-rank compute term. The
    fastest of ``repeats`` runs is kept, as another process can only add time.
    """
    from mpi4py import MPI

    from ..comm import Communicator
    from ..glm import solve

    alone = Communicator(MPI.COMM_SELF, check=False, uid="bench-glm-alone")
    best = np.zeros(len(configs))
    for turn in range(comm.size):
        _turn_wait(comm)
        if turn == comm.rank:
            for i, cfg in enumerate(configs):
                best[i] = min(solve(blocks, cfg, comm=alone).time_s for _ in range(repeats))
    _turn_wait(comm)
    comm.mpi.Allreduce(MPI.IN_PLACE, best, op=MPI.MAX)  # the slowest rank's block, one message for all
    return best.tolist()


def _measure(blocks: Any, spec: BenchSet, comm: Any, plan: list[tuple[Any, ...]], repeats: int,
             seed: int) -> list[dict[str, Any]]:
    """Time every configuration of one data set; return their rows (before the comparisons).

    Runs are interleaved, one pass over the plan per repeat, so that load from other
    processes hits every configuration alike; each row keeps the median over repeats
    of the slowest rank's training-loop time, and ``compute_s``, the same loop run
    alone on one rank's block (see ``_compute_alone``).
    """
    import commwire as cw
    from ..glm import SolverConfig, objective, solve
    from ..schedules import SStepGram

    configs = [SolverConfig(loss=spec.loss, solver=solver, s=k, batch_size=b, lr=spec.lr, l2=spec.l2,
                            precision=precision, max_steps=steps, tol=None, seed=seed)
               for _, solver, precision, k, b, steps in plan]
    for cfg in configs:  # compile the kernels and touch the pages before timing
        solve(blocks, dataclasses.replace(cfg, max_steps=min(cfg.max_steps, 2 * cfg.steps_per_exchange)), comm=comm)
    times: list[list[float]] = [[] for _ in configs]
    last: list[Any] = [None] * len(configs)
    for _ in range(repeats):
        for i, cfg in enumerate(configs):
            before = cw.stats().get("allreduce", {"calls": 0, "bytes": 0})
            comm.barrier()
            result = solve(blocks, cfg, comm=comm)
            after = cw.stats()["allreduce"]
            last[i] = (result, after["calls"] - before["calls"], after["bytes"] - before["bytes"])
            times[i].append(comm.mpi.allreduce(result.time_s, op=_max()))
    compute = _compute_alone(blocks, configs, comm, repeats)
    rows = []
    for (table, solver, precision, k, b, steps), cfg, samples, (result, calls, nbytes), alone in zip(
            plan, configs, times, last, compute):
        wall = float(np.median(samples))
        itemsize = cfg.precision.dtype("communication").itemsize
        rows.append({
            "table": table, "dataset": "", "solver": solver, "precision": precision, "s": cfg.steps_per_exchange,
            "b": b, "steps": steps, "ranks": comm.size, "wall_s": wall, "us_per_step": wall / steps * 1e6,
            "wall_best_s": float(min(samples)), "wall_samples_s": samples, "allreduces": calls, "bytes": nbytes,
            "bytes_per_outer": SStepGram.words(cfg.steps_per_exchange, b) * itemsize,
            "compute_s": alone, "compute_us_per_step": alone / steps * 1e6,
            "loss": objective(blocks, result.coef, result.intercept, loss=spec.loss, l2=spec.l2, comm=comm),
        })
    return rows


def _converge(blocks: Any, spec: BenchSet, comm: Any, plan: list[tuple[Any, ...]], repeats: int, seed: int,
              stop: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every configuration of ``plan`` ((solver, precision, s or "auto", b)) to convergence; return rows.

    Repeats are interleaved as in ``_measure``; a row keeps the median over repeats of
    the slowest rank's loop time plus (for "auto") its time choosing s, the steps and
    epochs of the run, the s each repeat chose, and the objective at the last repeat's
    weights.
    """
    import commwire as cw
    from ..glm import SolverConfig, objective, solve

    configs = [SolverConfig(loss=spec.loss, solver=solver, s=k, batch_size=b, lr=spec.lr, l2=spec.l2,
                            precision=precision, seed=seed, **stop) for solver, precision, k, b in plan]
    for cfg in configs:  # compile the kernels, touch the pages and connections before timing
        warm = 2 * cfg.s if isinstance(cfg.s, int) else 64
        solve(blocks, dataclasses.replace(cfg, max_steps=warm, tol=None), comm=comm)
    runs: list[list[tuple[float, Any, int]]] = [[] for _ in configs]
    for _ in range(repeats):
        for i, cfg in enumerate(configs):
            before = cw.stats().get("allreduce", {"calls": 0})["calls"]
            comm.barrier()
            result = solve(blocks, cfg, comm=comm)
            calls = cw.stats()["allreduce"]["calls"] - before - (result.auto.allreduces if result.auto else 0)
            tune = result.auto.tune_s if result.auto else 0.0
            runs[i].append((comm.mpi.allreduce(result.time_s + tune, op=_max()), result, calls))
    rows = []
    for (solver, precision, k, b), cfg, samples in zip(plan, configs, runs):
        walls = [w for w, _, _ in samples]
        per_step = [w / r.n_steps for w, r, _ in samples]
        chosen = [r.s for _, r, _ in samples]
        result, calls = samples[-1][1], samples[-1][2]
        tunes = [r.auto.tune_s for _, r, _ in samples if r.auto]
        rows.append({
            "table": "auto", "dataset": "", "solver": solver, "precision": precision,
            "s": max(set(chosen), key=chosen.count), "s_setting": k, "s_chosen": chosen, "b": b,
            "steps": int(np.median([r.n_steps for _, r, _ in samples])), "epochs": result.n_iter,
            "converged": all(r.converged for _, r, _ in samples), "ranks": comm.size,
            "wall_s": float(np.median(walls)), "wall_best_s": float(min(walls)), "wall_samples_s": walls,
            "us_per_step": float(np.median(per_step)) * 1e6, "us_per_step_best": float(min(per_step)) * 1e6,
            "tune_s": float(np.median(tunes)) if tunes else 0.0, "allreduces": calls,
            # What "auto" modelled per inner step for each candidate (the last repeat), to check
            # against the fixed-s rows.
            "auto_model_us": ({str(c): t * 1e6 for c, t in zip(result.auto.candidates, result.auto.step_s)}
                              if result.auto else None),
            "loss": objective(blocks, result.coef, result.intercept, loss=spec.loss, l2=spec.l2, comm=comm),
        })
    return rows


def _compare_auto(rows: list[dict[str, Any]]) -> None:
    """Add per-step and to-tol speed-ups and the loss gap at convergence against FP32 SGD of the same b."""
    base = {(r["dataset"], r["b"]): r for r in rows
            if r["table"] == "auto" and r["solver"] == "sgd" and r["precision"] == "fp32"}
    for r in rows:
        if r["table"] != "auto":
            continue
        ref = base.get((r["dataset"], r["b"]))
        nan = float("nan")
        r["speedup_per_step"] = ref["us_per_step"] / r["us_per_step"] if ref else nan
        r["speedup_to_tol"] = ref["wall_s"] / r["wall_s"] if ref else nan
        r["speedup_vs_sgd_fp32"] = r["speedup_per_step"]
        r["best_speedup_vs_sgd_fp32"] = ref["us_per_step_best"] / r["us_per_step_best"] if ref else nan
        r["loss_gap_vs_sgd_fp32"] = (r["loss"] - ref["loss"]) / abs(ref["loss"]) if ref else nan


def summarize_auto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return, per data set and b of the auto table, the best fixed s and s="auto" side by side."""
    out = []
    groups = dict.fromkeys((r["dataset"], r["b"]) for r in rows if r["table"] == "auto")
    for dataset, b in groups:
        part = [r for r in rows if r["table"] == "auto" and (r["dataset"], r["b"]) == (dataset, b)]
        fixed = [r for r in part if r["solver"] == "casgd" and r["s_setting"] != "auto"]
        auto = next((r for r in part if r["s_setting"] == "auto"), None)
        if not fixed or auto is None:
            continue
        best = max(fixed, key=lambda r: r["speedup_per_step"])
        out.append({"dataset": dataset, "b": b, "best_s": best["s"], "best_speedup": best["speedup_per_step"],
                    "best_speedup_to_tol": best["speedup_to_tol"], "best_loss_gap": best["loss_gap_vs_sgd_fp32"],
                    "auto_s": auto["s_chosen"], "auto_speedup": auto["speedup_per_step"],
                    "auto_speedup_to_tol": auto["speedup_to_tol"], "auto_loss_gap": auto["loss_gap_vs_sgd_fp32"],
                    "auto_tune_s": auto["tune_s"], "auto_vs_best": auto["speedup_per_step"] / best["speedup_per_step"],
                    "auto_vs_best_to_tol": auto["speedup_to_tol"] / best["speedup_to_tol"],
                    "auto_converged": auto["converged"], "sgd_epochs": next(
                        (r["epochs"] for r in part if r["solver"] == "sgd"), None)})
    return out


def _compare(rows: list[dict[str, Any]]) -> None:
    """Add speed-up and loss gap against FP32 SGD of the same data set, b and steps."""
    key = ("table", "dataset", "b", "steps")
    base = {tuple(r[k] for k in key): r for r in rows if r["solver"] == "sgd" and r["precision"] == "fp32"}
    for r in rows:
        if r["table"] == "auto":
            continue
        ref = base.get(tuple(r[k] for k in key))
        r["speedup_vs_sgd_fp32"] = ref["wall_s"] / r["wall_s"] if ref else float("nan")
        # Best-of-repeats ratio: other processes only ever add time, so the fastest repeat
        # of each configuration is the least disturbed one.
        r["best_speedup_vs_sgd_fp32"] = ref["wall_best_s"] / r["wall_best_s"] if ref else float("nan")
        r["loss_gap_vs_sgd_fp32"] = (r["loss"] - ref["loss"]) / abs(ref["loss"]) if ref else float("nan")


def run_glm_bench(*, datasets: list[str] | None = None, sweep: list[str] | None = None,
                  s: int = 32, b: int = 4, s_values: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                  b_values: tuple[int, ...] = (4, 16, 64), steps: int = 4096, sweep_steps: int = 1024,
                  auto: list[str] | None = None, auto_b: tuple[int, ...] = (4, 16),
                  auto_s: tuple[int, ...] = (2, 4, 8, 16, 32), tol: float = 1e-4, max_iter: int = 100,
                  n_iter_no_change: int = 5, repeats: int = 3, scale: float = 1.0, seed: int = 0,
                  comm: Any = None) -> list[dict[str, Any]]:
    """Run the headline comparison, the s x b sweep and the s="auto" table; return table rows.

    Args:
        datasets: names from DATASETS for the headline rows (FP32 SGD, mixed SGD, FP32
            and mixed CA-SGD at s, b); None: all.
        sweep: data sets swept over s_values x b_values (FP32 SGD and mixed CA-SGD per b);
            None: susy-like and epsilon-like.
        steps, sweep_steps: inner steps per run, the same for every solver.
        auto: data sets of the auto table, run to convergence per b in auto_b: FP32 SGD, mixed
            CA-SGD at each s of auto_s and at s="auto"; None: logistic-20k.
        tol, max_iter, n_iter_no_change: the stopping rule of the auto table (SolverConfig's).
        repeats: interleaved timed runs per configuration (median of the slowest rank's time).
        scale: multiply every data set's row count (quick runs).
        comm: the Communicator (None: the world).
    """
    if comm is None:
        import commwire as cw

        comm = cw.init()
    datasets = list(DATASETS) if datasets is None else datasets
    sweep = ["susy-like", "epsilon-like"] if sweep is None else sweep
    auto = ["logistic-20k"] if auto is None else auto
    for name in [*datasets, *sweep, *auto]:
        if name not in DATASETS:
            raise ValueError(f"data set {name!r} is unknown; choose from {list(DATASETS)}")
    latency_before = _latency_us(comm)
    rows: list[dict[str, Any]] = []
    stop = {"tol": tol, "max_iter": max_iter, "n_iter_no_change": n_iter_no_change}
    for name in dict.fromkeys([*datasets, *sweep, *auto]):
        spec, blocks = DATASETS[name], _blocks(name, comm, seed, scale)
        plan = []
        if name in datasets:
            plan += [("headline", solver, precision, k, b, steps)
                     for solver, precision, k in (("sgd", "fp32", 1), ("sgd", "mixed", 1),
                                                  ("casgd", "fp32", s), ("casgd", "mixed", s))]
        if name in sweep:
            for bb in b_values:
                plan.append(("sweep", "sgd", "fp32", 1, bb, sweep_steps))
                plan += [("sweep", "casgd", "mixed", k, bb, sweep_steps) for k in s_values
                         if k * bb <= blocks.n_samples]
        if plan:
            for row in _measure(blocks, spec, comm, list(dict.fromkeys(plan)), repeats, seed):
                row.update(dataset=name, m=blocks.n_samples, n=spec.n)
                rows.append(row)
        if name in auto:
            converge = []
            for bb in auto_b:
                converge.append(("sgd", "fp32", 1, bb))
                converge += [("casgd", "mixed", k, bb) for k in auto_s if k * bb <= blocks.n_samples]
                converge.append(("casgd", "mixed", "auto", bb))
            for row in _converge(blocks, spec, comm, converge, repeats, seed, stop):
                row.update(dataset=name, m=blocks.n_samples, n=spec.n, tol=tol)
                rows.append(row)
        del blocks
    _compare(rows)
    _compare_auto(rows)
    latency_after = _latency_us(comm)
    for r in rows:
        r["small_allreduce_us"] = (latency_before, latency_after)
    return rows


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def _spread(row: dict[str, Any]) -> str:
    """Return (max - min) / median of the timed repeats: the noise to read the speed-ups against."""
    samples = row["wall_samples_s"]
    return f"{100 * (max(samples) - min(samples)) / row['wall_s']:.0f}%"


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render benchmark rows as Markdown tables (headline, sweep, then the auto table and its summary)."""
    if not rows:
        return "(no rows)"
    head = ["data set", "m x n", "solver", "precision", "s", "b", "steps", "wall s", "spread", "µs/step",
            "compute µs/step", "allreduces", "bytes/rank", "bytes/outer", "final loss", "loss gap",
            "speed-up vs FP32 SGD", "best-of speed-up"]
    before, after = rows[0]["small_allreduce_us"]
    out = [f"{rows[0]['ranks']} ranks; a 16-float allreduce took {before:.1f} µs before the runs and "
           f"{after:.1f} µs after them (median, slowest rank). Wall time: median of the interleaved "
           f"repeats of the slowest rank's training loop; spread: (max - min) / median; compute: the same "
           f"loop alone on the slowest rank's block, no communication (the cost model's compute term)."]
    for table in ("headline", "sweep"):
        part = [r for r in rows if r["table"] == table]
        if not part:
            continue
        out += ["", f"### {table}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in part:
            out.append("| " + " | ".join([
                r["dataset"], f"{r['m']} x {r['n']}", r["solver"], r["precision"], str(r["s"]), str(r["b"]),
                str(r["steps"]), f"{r['wall_s']:.3f}", _spread(r), f"{r['us_per_step']:.1f}",
                f"{r['compute_us_per_step']:.1f}", str(r["allreduces"]),
                _human(r["bytes"]), _human(r["bytes_per_outer"]), f"{r['loss']:.6f}",
                f"{100 * r['loss_gap_vs_sgd_fp32']:+.3f}%", f"{r['speedup_vs_sgd_fp32']:.2f}x",
                f"{r['best_speedup_vs_sgd_fp32']:.2f}x",
            ]) + " |")
    out += _format_auto(rows)
    return "\n".join(out)


def _format_auto(rows: list[dict[str, Any]]) -> list[str]:
    part = [r for r in rows if r["table"] == "auto"]
    if not part:
        return []
    head = ["data set", "m x n", "solver", "precision", "s", "b", "epochs", "steps", "wall s to tol", "spread",
            "µs/step", "tuning ms", "allreduces", "final loss", "loss gap", "speed-up per step", "best-of per step",
            "speed-up to tol"]
    out = ["", f"### auto: s chosen at fit time vs fixed s, each run to convergence (tol={part[0]['tol']:g})", "",
           "Speed-up: FP32 SGD's µs/step over the row's, both to convergence (\"auto\" pays its tuning); loss gap "
           "at convergence. s of \"auto\": the s chosen in each repeat.", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in part:
        s = (f"auto → {','.join(map(str, r['s_chosen']))}" if r["s_setting"] == "auto" else str(r["s"]))
        epochs = f"{r['epochs']}" + ("" if r["converged"] else " (cap)")
        out.append("| " + " | ".join([
            r["dataset"], f"{r['m']} x {r['n']}", r["solver"], r["precision"], s, str(r["b"]), epochs,
            str(r["steps"]), f"{r['wall_s']:.3f}", _spread(r), f"{r['us_per_step']:.1f}",
            f"{r['tune_s'] * 1e3:.0f}" if r["s_setting"] == "auto" else "-", str(r["allreduces"]),
            f"{r['loss']:.6f}", f"{100 * r['loss_gap_vs_sgd_fp32']:+.3f}%", f"{r['speedup_per_step']:.2f}x",
            f"{r['best_speedup_vs_sgd_fp32']:.2f}x", f"{r['speedup_to_tol']:.2f}x"]) + " |")
    summary = summarize_auto(rows)
    if summary:
        out += ["", "| data set | b | best fixed s | its speed-up | \"auto\" chose | \"auto\" speed-up | "
                "auto / best | to tol: best, auto, auto / best | loss gap: best, auto |", "|" + "---|" * 9]
        for x in summary:
            out.append(f"| {x['dataset']} | {x['b']} | {x['best_s']} | {x['best_speedup']:.2f}x | "
                       f"{','.join(map(str, x['auto_s']))} | {x['auto_speedup']:.2f}x | "
                       f"{100 * x['auto_vs_best']:.0f}% | "
                       f"{x['best_speedup_to_tol']:.2f}x, {x['auto_speedup_to_tol']:.2f}x, "
                       f"{100 * x['auto_vs_best_to_tol']:.0f}% | {100 * x['best_loss_gap']:+.3f}%, "
                       f"{100 * x['auto_loss_gap']:+.3f}% |")
    return out


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers like 1,2,4") from None


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench glm``."""
    parser = argparse.ArgumentParser(prog="commwire bench glm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default=",".join(DATASETS), help="headline data sets (comma-separated)")
    parser.add_argument("--sweep", default="susy-like,epsilon-like",
                        help="data sets to sweep over s and b ('' for none)")
    parser.add_argument("--s", type=int, default=32, help="s of the headline CA-SGD rows")
    parser.add_argument("--b", type=int, default=4, help="batch size of the headline rows")
    parser.add_argument("--s-values", default="1,2,4,8,16,32", help="s values of the sweep")
    parser.add_argument("--b-values", default="4,16,64", help="batch sizes of the sweep")
    parser.add_argument("--auto", default="logistic-20k",
                        help="data sets of the s='auto' table, run to convergence ('' for none)")
    parser.add_argument("--auto-b", default="4,16", help="batch sizes of the auto table")
    parser.add_argument("--auto-s", default="2,4,8,16,32", help="fixed s values the auto table compares with")
    parser.add_argument("--tol", type=float, default=1e-4, help="stopping tolerance of the auto table")
    parser.add_argument("--max-iter", type=int, default=100, help="epoch cap of the auto table")
    parser.add_argument("--n-iter-no-change", type=int, default=5, help="patience (epochs) of the auto table")
    parser.add_argument("--steps", type=int, default=4096, help="inner steps of each headline run")
    parser.add_argument("--sweep-steps", type=int, default=1024, help="inner steps of each sweep run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed runs per row (median kept)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the data sets' row counts")
    parser.add_argument("--seed", type=int, default=0, help="data and batch seed")
    parser.add_argument("--blas-threads", type=int, default=None,
                        help="BLAS (and codec) threads per rank; default: this rank's share of the cores")
    parser.add_argument("--json", dest="json_path", help="also write the rows as JSON here")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Refuse an unknown data set in ``--datasets`` or ``--sweep`` with a ValueError that names the option."""
    for option, text in (("--datasets", args.datasets), ("--sweep", args.sweep)):
        unknown = [name for name in filter(None, (s.strip() for s in text.split(","))) if name not in DATASETS]
        if unknown:
            raise ValueError(f"{option}: data set {unknown[0]!r} is unknown; choose from {', '.join(DATASETS)}")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the benchmark on the current MPI world, print rank 0's tables."""
    args = build_parser().parse_args(argv)
    import commwire as cw
    from ..codecs import set_threads

    names = [v for v in args.datasets.split(",") if v.strip()]
    sweep = [v for v in args.sweep.split(",") if v.strip()]
    auto = [v for v in args.auto.split(",") if v.strip()]
    if args.blas_threads is not None:
        set_threads(args.blas_threads)  # the solver limits BLAS to this (commwire.codecs thread policy)
    rows = run_glm_bench(datasets=names, sweep=sweep, s=args.s, b=args.b, s_values=_ints(args.s_values),
                         b_values=_ints(args.b_values), steps=args.steps, sweep_steps=args.sweep_steps,
                         auto=auto, auto_b=_ints(args.auto_b), auto_s=_ints(args.auto_s), tol=args.tol,
                         max_iter=args.max_iter, n_iter_no_change=args.n_iter_no_change,
                         repeats=args.repeats, scale=args.scale, seed=args.seed)
    emit(format_table(rows), rows, args.json_path, rank=cw.rank())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
