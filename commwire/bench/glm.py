"""Benchmark GLM SGD against CA-SGD (s-step Gram exchange) on synthetic dense sets.

Every configuration runs the same inner steps on the same batches; rows report
the training-loop wall time (slowest rank, median of repeats), the allreduce
count and bytes this rank handed to MPI, the final objective (mean loss +
l2/2 ||w||^2, float64 over all rows) and, against FP32 SGD with the same batch
size and steps, the speed-up and the relative loss gap. The sweep over s and b
is reported in full, including the configurations where CA-SGD loses.

The benchmark uses whatever MPI world it is launched in, so the same command
measures shared memory on one host (``mpiexec -n 4``) and TCP between hosts
(the ``commwire lab`` namespaces). The header line gives the measured latency
of a 16-float allreduce, which tells the two regimes apart. Each row also gives
the loop's compute alone (every rank in turn runs it on its own block with no
communication while the others sleep): ``commwire bench project --glm`` models
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

__all__ = ["DATASETS", "run_glm_bench", "format_table", "main"]


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


def _compare(rows: list[dict[str, Any]]) -> None:
    """Add speed-up and loss gap against FP32 SGD of the same data set, b and steps."""
    key = ("table", "dataset", "b", "steps")
    base = {tuple(r[k] for k in key): r for r in rows if r["solver"] == "sgd" and r["precision"] == "fp32"}
    for r in rows:
        ref = base.get(tuple(r[k] for k in key))
        r["speedup_vs_sgd_fp32"] = ref["wall_s"] / r["wall_s"] if ref else float("nan")
        # Best-of-repeats ratio: other processes only ever add time, so the fastest repeat
        # of each configuration is the least disturbed one.
        r["best_speedup_vs_sgd_fp32"] = ref["wall_best_s"] / r["wall_best_s"] if ref else float("nan")
        r["loss_gap_vs_sgd_fp32"] = (r["loss"] - ref["loss"]) / abs(ref["loss"]) if ref else float("nan")


def run_glm_bench(*, datasets: list[str] | None = None, sweep: list[str] | None = None,
                  s: int = 32, b: int = 4, s_values: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                  b_values: tuple[int, ...] = (4, 16, 64), steps: int = 4096, sweep_steps: int = 1024,
                  repeats: int = 3, scale: float = 1.0, seed: int = 0, comm: Any = None) -> list[dict[str, Any]]:
    """Run the headline comparison on each data set and the s x b sweep; return table rows.

    Args:
        datasets: names from DATASETS for the headline rows (FP32 SGD, mixed SGD, FP32
            and mixed CA-SGD at s, b); None: all.
        sweep: data sets swept over s_values x b_values (FP32 SGD and mixed CA-SGD per b);
            None: susy-like and epsilon-like.
        steps, sweep_steps: inner steps per run, the same for every solver.
        repeats: interleaved timed runs per configuration (median of the slowest rank's time).
        scale: multiply every data set's row count (quick runs).
        comm: the Communicator (None: the world).
    """
    if comm is None:
        import commwire as cw

        comm = cw.init()
    datasets = list(DATASETS) if datasets is None else datasets
    sweep = ["susy-like", "epsilon-like"] if sweep is None else sweep
    for name in [*datasets, *sweep]:
        if name not in DATASETS:
            raise ValueError(f"data set {name!r} is unknown; choose from {list(DATASETS)}")
    latency_before = _latency_us(comm)
    rows: list[dict[str, Any]] = []
    for name in dict.fromkeys([*datasets, *sweep]):
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
        for row in _measure(blocks, spec, comm, list(dict.fromkeys(plan)), repeats, seed):
            row.update(dataset=name, m=blocks.n_samples, n=spec.n)
            rows.append(row)
        del blocks
    _compare(rows)
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
    """Render benchmark rows as Markdown tables (headline, then sweep)."""
    if not rows:
        return "(no rows)"
    head = ["data set", "m x n", "solver", "precision", "s", "b", "steps", "wall s", "spread", "µs/step",
            "compute µs/step", "allreduces", "bytes/rank", "bytes/outer", "final loss", "loss gap", "speed-up vs FP32 SGD",
            "best-of speed-up"]
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
    return "\n".join(out)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers like 1,2,4") from None


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the benchmark on the current MPI world, print rank 0's tables."""
    parser = argparse.ArgumentParser(prog="commwire bench glm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default=",".join(DATASETS), help="headline data sets (comma-separated)")
    parser.add_argument("--sweep", default="susy-like,epsilon-like",
                        help="data sets to sweep over s and b ('' for none)")
    parser.add_argument("--s", type=int, default=32, help="s of the headline CA-SGD rows")
    parser.add_argument("--b", type=int, default=4, help="batch size of the headline rows")
    parser.add_argument("--s-values", default="1,2,4,8,16,32", help="s values of the sweep")
    parser.add_argument("--b-values", default="4,16,64", help="batch sizes of the sweep")
    parser.add_argument("--steps", type=int, default=4096, help="inner steps of each headline run")
    parser.add_argument("--sweep-steps", type=int, default=1024, help="inner steps of each sweep run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed runs per row (median kept)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the data sets' row counts")
    parser.add_argument("--seed", type=int, default=0, help="data and batch seed")
    parser.add_argument("--blas-threads", type=int, default=None,
                        help="BLAS (and codec) threads per rank; default: this rank's share of the cores")
    parser.add_argument("--json", dest="json_path", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    import commwire as cw
    from ..codecs import set_threads

    names = [v for v in args.datasets.split(",") if v.strip()]
    sweep = [v for v in args.sweep.split(",") if v.strip()]
    if args.blas_threads is not None:
        set_threads(args.blas_threads)  # the solver limits BLAS to this (commwire.codecs thread policy)
    rows = run_glm_bench(datasets=names, sweep=sweep, s=args.s, b=args.b, s_values=_ints(args.s_values),
                         b_values=_ints(args.b_values), steps=args.steps, sweep_steps=args.sweep_steps,
                         repeats=args.repeats, scale=args.scale, seed=args.seed)
    emit(format_table(rows), rows, args.json_path, rank=cw.rank())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
