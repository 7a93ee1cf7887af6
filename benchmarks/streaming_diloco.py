"""Wall-clock of DiLoCo's blocking sync against Streaming DiLoCo's fragments in flight, on a real link.

Every arm trains the same TinyGPT (``commwire.bench.lm``) from the same weights
on the same per-rank batches with DiLoCo's recipe (inner AdamW, outer Nesterov
SGD 0.7 / 0.9), K = ``--sync-every`` steps per period; only the sync differs:

- ``local``: no sync inside the timed steps (sync_every beyond the run): the compute floor;
- ``diloco``: the whole model in one blocking all-reduce every K steps;
- ``fragments``: 4 fragments taking turns (one every K/4 steps), each blocking (τ = 0);
- ``streaming``: the same 4 fragments, each in flight on the background lane for
  τ = ``--delay`` steps (default 1) while the next steps compute, α = 0.5 (Streaming DiLoCo).

Reported per arm (median and range over ``--repeats``, arms interleaved): seconds
per step (the slowest rank's wall time over the timed steps), the sync time a step
exposes (arm − local), the slowest single step (the stall a sync adds) and the
largest message. One untimed period first (lane threads, allocations). The
training effect of the same settings (validation loss, 3 seeds, one LR grid) is
``benchmarks/lordo.py --arms diloco,streaming-diloco``.

Run: ``commwire lab up --hosts 2``, then ``commwire run --lab -np 2 python benchmarks/streaming_diloco.py``
(one core per rank: with more ranks than cores a rank waiting on the network hands its core to
another, and a blocking sync is hidden anyway); ``--quick``: a smoke run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

ARMS = {
    "local": {},
    "diloco": {},
    "fragments": {"fragments": 4},
    "streaming": {"fragments": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5},
}


def run_arm(arm: str, args: argparse.Namespace, corpus: Any, comm: Any, seed: int) -> dict[str, float]:
    """Train ``arm`` for one untimed period and ``args.periods`` timed ones; return its timings on every rank."""
    import torch

    import commwire.torch as hvd
    from commwire.bench.lm import LMConfig, make_lm

    cfg = LMConfig(d_model=args.d_model, layers=args.layers, heads=args.heads, context=args.context)
    model = make_lm(cfg, seed=seed)
    k = args.sync_every
    total = (1 + args.periods) * k
    options = dict(ARMS[arm])
    if arm == "streaming":
        options["fragment_sync_delay"] = args.delay
    opt = hvd.DiLoCo(model.named_parameters(), lr=args.lr, sync_every=k if arm != "local" else 2 * total,
                     codec=args.codec, **options)
    gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + comm.rank)
    times = []
    comm.barrier()
    for _ in range(total):
        x, y = corpus.batch("train", batch=args.batch, context=args.context, generator=gen)
        start = time.perf_counter()
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    timed = np.array(times[k:])
    mine = np.array([timed.sum(), timed.max()])
    slowest = comm.allreduce(mine, "max")
    return {"s_per_step": float(slowest[0] / timed.size), "max_step_s": float(slowest[1]),
            "largest_sync_bytes": float(opt.bytes_per_sync if arm != "local" else 0),
            "bytes_per_step": float(opt.bytes_per_step if arm != "local" else 0)}


def summarize(rows: list[dict[str, Any]]) -> str:
    """Render the rows as a Markdown table: median (min–max) per arm, exposed sync time against ``local``."""
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    local = np.median([r["s_per_step"] for r in rows if r["arm"] == "local"]) if "local" in arms else None
    lines = ["| arm | ms per step | exposed sync ms per step | slowest step ms | largest sync | bytes per step |",
             "|---|---|---|---|---|---|"]
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        step = np.array([r["s_per_step"] for r in mine]) * 1e3
        worst = np.array([r["max_step_s"] for r in mine]) * 1e3
        exposed = "–" if local is None else f"{np.median(step) - 1e3 * local:.1f}"
        lines.append(f"| {arm} | {np.median(step):.1f} ({step.min():.1f}–{step.max():.1f}) | {exposed} | "
                     f"{np.median(worst):.0f} ({worst.min():.0f}–{worst.max():.0f}) | "
                     f"{mine[0]['largest_sync_bytes'] / 2 ** 20:.2f} MiB | {mine[0]['bytes_per_step'] / 1e3:.1f} kB |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list from {', '.join(ARMS)}")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--sync-every", type=int, default=16, help="K, a multiple of 4 (the fragments)")
    p.add_argument("--periods", type=int, default=3, help="timed periods of K steps after the untimed one")
    p.add_argument("--delay", type=int, default=1, help="τ of the streaming arm (< sync_every / 4)")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--codec", default=None, help="wire format of the pseudo-gradients (default FP32)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every arm, interleaved (seed = repeat)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 periods of 8, 1 repeat: a smoke run")
    p.add_argument("--json", help="write every run's row to this file")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise SystemExit(f"--arms: {bad} unknown; choose from {', '.join(ARMS)}")
    if args.sync_every % 4:
        raise SystemExit(f"--sync-every {args.sync_every} must be a multiple of 4 (the fragments)")
    if args.quick:
        args.d_model, args.layers, args.heads, args.sync_every, args.periods, args.repeats = 32, 1, 2, 8, 2, 1
    import torch

    import commwire as cw
    from commwire.bench.lm import Corpus

    torch.set_num_threads(args.threads)
    comm = cw.init()
    corpus = Corpus.load()
    rows = []
    for repeat in range(args.repeats):
        for arm in arms:
            rows.append({"arm": arm, "repeat": repeat, **run_arm(arm, args, corpus, comm, seed=repeat)})
    if comm.rank == 0:
        print(f"{comm.size} ranks; TinyGPT d_model={args.d_model}, {args.layers} layers, batch {args.batch}x"
              f"{args.context}/rank; K={args.sync_every}, {args.periods} timed periods; streaming τ={args.delay}; "
              f"codec {args.codec or 'FP32'}; "
              f"{args.threads} torch thread(s); median (min–max) over {args.repeats} runs\n")
        print(summarize(rows), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({"args": vars(args), "ranks": comm.size, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
