"""Does ``commwire.StragglerMonitor`` name a slow rank in real training, and only that rank?

Every rank trains the same TinyGPT (``commwire.bench.lm``) under
``DistributedOptimizer`` (AdamW, FP32 gradients) on its own batches, with the
monitor reporting every ``--every`` steps. Arms, interleaved, one run each per
repeat (seed = repeat):

- ``even``: every rank does the same work (a false alarm is any rank named);
- ``slow``: rank ``--slow-rank`` trains on ``--factor`` times the sequences per step:
  its forward and backward take that much longer (real extra compute, as on a device
  that much slower), with its gradient buckets moving beside its longer backward.

Reported per arm: windows; windows that named exactly the slow rank; windows
that named another rank; the slow rank's relative score (median over windows)
and the lowest score of any other rank; ms per step (the slowest rank's wall
time). The first window is left out (allocations, first calls).

Run: ``commwire run --lab -np 2 python benchmarks/stragglers.py`` (one core per
rank: ``commwire lab up --hosts 2``); ``--quick``: a smoke run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np


def run_arm(arm: str, args: argparse.Namespace, corpus: Any, comm: Any, seed: int) -> dict[str, Any]:
    """Train one arm for ``args.windows`` windows after a warm-up one; return what its monitor reported."""
    import torch

    import commwire as cw
    import commwire.torch as hvd
    from commwire.bench.lm import LMConfig, make_lm

    cfg = LMConfig(d_model=args.d_model, layers=args.layers, heads=args.heads, context=args.context)
    model = make_lm(cfg, seed=seed)
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    batch = args.batch * (args.factor if arm == "slow" and comm.rank == args.slow_rank else 1)
    gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + comm.rank)
    mon = cw.StragglerMonitor(every=args.every, threshold=args.threshold)
    reports = []
    comm.barrier()
    start = None
    for step in range((1 + args.windows) * args.every):
        x, y = corpus.batch("train", batch=batch, context=args.context, generator=gen)
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
        report = mon.step()
        if report is not None:
            if report.window == 0:
                start = time.perf_counter()  # the first window is the warm-up
            else:
                reports.append(report)
    wall = comm.allreduce(np.array([time.perf_counter() - start]), "max")[0]
    slow = args.slow_rank if arm == "slow" else None
    others = [r for r in range(comm.size) if r != slow]
    return {"arm": arm, "seed": seed, "windows": len(reports),
            "named_slow": sum(rep.stragglers == [slow] for rep in reports) if slow is not None else 0,
            "named_other": sum(any(r in rep.stragglers for r in others) for rep in reports),
            "slow_score": float(np.median([rep.relative[slow] for rep in reports])) if slow is not None else None,
            "min_other_score": min((rep.relative[r] for rep in reports for r in others), default=None),
            "ms_per_step": float(1e3 * wall / (args.windows * args.every)),
            "last_report": str(reports[-1])}


def summarize(rows: list[dict[str, Any]]) -> str:
    """Render the rows as Markdown: per arm and seed, then the totals."""
    lines = ["| arm | seed | windows | named the slow rank alone | named another rank | slow rank's score "
             "(median) | lowest other score | ms per step |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        slow = "–" if r["slow_score"] is None else f"{r['slow_score']:.2f}"
        named = "–" if r["arm"] == "even" else f"{r['named_slow']}"
        other = "–" if r["min_other_score"] is None else f"{r['min_other_score']:.2f}"
        lines.append(f"| {r['arm']} | {r['seed']} | {r['windows']} | {named} | {r['named_other']} | {slow} | "
                     f"{other} | {r['ms_per_step']:.1f} |")
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        windows = sum(r["windows"] for r in mine)
        hits = "" if arm == "even" else f"slow rank named alone in {sum(r['named_slow'] for r in mine)}/{windows}; "
        lines.append(f"\n{arm}: {hits}another rank named in {sum(r['named_other'] for r in mine)}/{windows} windows")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--every", type=int, default=20, help="steps per monitor window")
    p.add_argument("--windows", type=int, default=5, help="windows reported after the warm-up one")
    p.add_argument("--threshold", type=float, default=0.8)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--factor", type=int, default=2, help="the slow rank's batch, in multiples of --batch")
    p.add_argument("--repeats", type=int, default=3, help="runs of each arm, interleaved (seed = repeat)")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 windows of 5 steps, 1 repeat")
    p.add_argument("--json", help="write the rows to this file")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.factor < 2:
        raise SystemExit(f"--factor {args.factor}: the slow rank needs at least twice the batch")
    if args.quick:
        args.d_model, args.layers, args.heads, args.every, args.windows, args.repeats = 32, 1, 2, 5, 2, 1
    import torch

    import commwire as cw
    from commwire.bench.lm import Corpus

    torch.set_num_threads(1)
    comm = cw.init()
    if not 0 <= args.slow_rank < comm.size:
        raise SystemExit(f"--slow-rank {args.slow_rank} is not a rank of this {comm.size}-rank job")
    corpus = Corpus.load()
    rows = [run_arm(arm, args, corpus, comm, seed) for seed in range(args.repeats) for arm in ("even", "slow")]
    if comm.rank == 0:
        print(f"{comm.size} ranks; TinyGPT d_model={args.d_model}, {args.layers} layers, batch {args.batch}x"
              f"{args.context}/rank; DistributedOptimizer(AdamW); monitor every {args.every} steps, threshold "
              f"{args.threshold}; slow arm: rank {args.slow_rank} trains on {args.factor}x the batch\n")
        print(summarize(rows))
        print("\nlast report of the last slow run:\n" + rows[-1]["last_report"], flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({"args": vars(args), "ranks": comm.size, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
