"""Benchmark Horovod-style grouped all-reduce against one fused all-reduce of the same bytes.

Three ways to reduce ``--tensors`` small float32 tensors through commwire.torch,
all through the same path (the process set's lane, the per-call agreement),
interleaved batch by batch in the same job so that noise hits them alike:

- ``grouped``: ``hvd.grouped_allreduce(tensors)`` — fused into one collective;
- ``one tensor``: ``hvd.allreduce`` of a single tensor holding the same bytes
  (the floor: no packing at all);
- ``fused by hand``: what a user does without grouped ops: ``torch.cat``, one
  ``hvd.allreduce``, ``split`` and ``view_as`` back into 100 tensors;
- ``separate``: one ``hvd.allreduce`` per tensor (what fusion saves).

Each row reports the median per-call time of the slowest rank and the ratios.

Run: ``commwire bench grouped -np 4`` (or ``mpiexec -n 4 python -m commwire.bench.grouped``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from ._report import emit

__all__ = ["NAME", "HELP", "DRIVER", "build_parser", "run_grouped_bench", "main"]

NAME = "grouped"
HELP = "grouped_allreduce of many small tensors vs one fused allreduce of the same bytes"
DRIVER = False


def _median_slowest(comm: Any, fn: Callable[[], Any], iters: int) -> float:
    comm.mpi.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    mine = (time.perf_counter() - start) / iters
    from mpi4py import MPI

    return float(comm.mpi.allreduce(mine, op=MPI.MAX))


def run_grouped_bench(tensors: int, elements: int, *, iters: int = 50, repeats: int = 7) -> dict[str, Any]:
    """Time the four variants; return one row (seconds per call and ratios)."""
    import torch

    import commwire.torch as hvd

    hvd.init()
    from commwire.comm.runtime import world

    comm = world()
    gen = torch.Generator().manual_seed(comm.rank)
    small = [torch.randn(elements, generator=gen) for _ in range(tensors)]
    flat = torch.cat(small)
    sizes = [t.numel() for t in small]
    variants = {
        "grouped": lambda: hvd.grouped_allreduce(small, op=hvd.Sum, name="bench.grouped"),
        "one tensor": lambda: hvd.allreduce(flat, op=hvd.Sum, name="bench.one"),
        "by hand": lambda: [p.view_as(t) for p, t in zip(
            hvd.allreduce(torch.cat(small), op=hvd.Sum, name="bench.hand").split(sizes), small)],
        "separate": lambda: [hvd.allreduce(t, op=hvd.Sum, name=f"bench.sep.{i}") for i, t in enumerate(small)],
    }
    want = hvd.allreduce(flat, op=hvd.Sum)
    got = torch.cat(variants["grouped"]())
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        raise RuntimeError("grouped_allreduce and allreduce disagree; the benchmark would compare wrong results")
    for fn in variants.values():  # warm up: lanes, agreement of each name, page faults
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for key, fn in variants.items():
            samples[key].append(_median_slowest(comm, fn, iters if key != "separate" else max(1, iters // 10)))
    t = {k: float(np.median(v)) for k, v in samples.items()}
    return {
        "ranks": comm.size, "tensors": tensors, "elements_each": elements, "bytes": tensors * elements * 4,
        "grouped_us": t["grouped"] * 1e6, "one_tensor_us": t["one tensor"] * 1e6, "by_hand_us": t["by hand"] * 1e6,
        "separate_us": t["separate"] * 1e6, "grouped_vs_one": t["grouped"] / t["one tensor"],
        "grouped_vs_by_hand": t["grouped"] / t["by hand"], "separate_vs_grouped": t["separate"] / t["grouped"],
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render the rows as a Markdown table."""
    lines = ["| ranks | tensors × floats | grouped µs | one tensor µs | fused by hand µs | separate µs | "
             "grouped / one | grouped / by hand | separate / grouped |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['tensors']} × {r['elements_each']} | {r['grouped_us']:.0f} | "
                     f"{r['one_tensor_us']:.0f} | {r['by_hand_us']:.0f} | {r['separate_us']:.0f} | "
                     f"{r['grouped_vs_one']:.2f}× | {r['grouped_vs_by_hand']:.2f}× | {r['separate_vs_grouped']:.1f}× |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench grouped``."""
    parser = argparse.ArgumentParser(prog="commwire bench grouped", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=100, help="number of tensors (default 100)")
    parser.add_argument("--elements", default="16,256,4096",
                        help="floats per tensor, comma-separated (default 16,256,4096)")
    parser.add_argument("--iters", type=int, default=50, help="calls per timed batch (default 50)")
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per variant (default 7)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the benchmark, print the table on rank 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sizes = [int(v) for v in args.elements.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--elements {args.elements!r} must be integers like 16,256,4096")
    if args.tensors < 1 or any(s < 1 for s in sizes):
        parser.error("--tensors and --elements must be >= 1")
    rows = [run_grouped_bench(args.tensors, n, iters=args.iters, repeats=args.repeats) for n in sizes]
    from commwire.comm.runtime import world

    emit(format_table(rows), rows, args.json, rank=world().rank)


if __name__ == "__main__":
    main()
