"""Compare DDP-Adam, low-rank DDP, DiLoCo, LoRDO and LoRDO(ω = 1) on a byte-level language model.

Every method trains the same TinyGPT (``commwire.bench.lm``) from the same
initial weights on the same per-rank batches of the Python documentation text
for the same number of steps, in one MPI job, with the optimizer settings of
``benchmarks/lordo.py`` (same clipping, LR schedule, outer steps). Reported
per method: final validation loss (nats/byte, the whole validation split),
bytes handed to MPI per step (``commwire.stats()``, this rank), its ratio to
DDP, optimizer-state memory and training wall time. For the two LoRDO runs the
stagnation diagnostics are plotted: at every sync the subspace similarity of
consecutive projections (1 = same subspace) and the numerical rank of the
averaged pseudo-gradient relative to r.

This is one seed, for the curves and figures. Each method's peak LR defaults
to its best LR in ``benchmarks/lordo.py`` (the same grid for every method,
3 seeds, 256 steps: ``TUNED_LR``); the tuned comparison with mean ± std over
seeds is that benchmark's table, not this example's.

Writes into ``--out`` (default reports/lordo/): loss.png, bytes.png,
stagnation.png, summary.md, results.json; prints the table.

Run:
    commwire run -np 4 python examples/lordo_lm.py
    commwire run -np 4 python examples/lordo_lm.py --steps 128 --methods ddp,lordo --lr lordo=6e-3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import commwire as cw
import commwire.torch as hvd
from commwire.bench.lm import Corpus, LMConfig, make_lm

# The training arms and their tuned settings are the LoRDO study's, run from a checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lordo as sweep  # noqa: E402

METHODS = ("ddp", "lowrank-ddp", "diloco", "lordo", "lordo-omega1")
LABELS = {m: sweep.ARMS[m].label for m in METHODS}
TUNED_LR = {"ddp": 3e-3, "lowrank-ddp": 1.2e-2, "diloco": 1.5e-3, "lordo": 6e-3, "lordo-omega1": 6e-3}
"""Best peak LR per method in the LoRDO study (``benchmarks/lordo.py``, grid 1.5e-3 ... 1.2e-2, 3 seeds, 256 steps)."""


def _lrs(text: str) -> dict[str, float]:
    if "=" not in text:
        return dict.fromkeys(METHODS, float(text))
    out = dict(TUNED_LR)
    for item in filter(None, text.split(",")):
        method, _, value = item.partition("=")
        if method not in METHODS:
            raise argparse.ArgumentTypeError(f"{method!r} is not a method; choose from {','.join(METHODS)}")
        out[method] = float(value)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    d = sweep.Setup()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=d.steps, help="training steps per method (multiple of --sync-every)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list from {','.join(METHODS)}")
    p.add_argument("--lr", type=_lrs, default=dict(TUNED_LR),
                   help="peak LR: one value for every method, or method=lr,... (default: TUNED_LR)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--context", type=int, default=d.context)
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per step")
    p.add_argument("--sync-every", type=int, default=d.sync_every,
                   help="K for DiLoCo and LoRDO; basis refresh of low-rank DDP")
    p.add_argument("--rank", type=int, default=d.rank, help="r for the low-rank methods")
    p.add_argument("--omega", type=float, default=d.omega)
    p.add_argument("--clip", type=float, default=d.clip, help="global gradient-norm clip of every method")
    p.add_argument("--sync-states", default="", help="LoRDO states averaged at a sync, e.g. moments,error_feedback")
    p.add_argument("--eval-every", type=int, default=64, help="steps between validation losses")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="reports/lordo")
    args = p.parse_args(argv)
    bad = [m for m in args.methods.split(",") if m not in METHODS]
    if bad:
        p.error(f"unknown methods {bad}; choose from {','.join(METHODS)}")
    if args.steps % args.sync_every or args.eval_every % args.sync_every:
        p.error(f"--steps={args.steps} and --eval-every={args.eval_every} must be multiples of "
                f"--sync-every={args.sync_every} (local methods are evaluated right after a sync)")
    return args


def setup_of(args: argparse.Namespace) -> sweep.Setup:
    """Return the benchmark setup these arguments describe."""
    states = tuple(s for s in args.sync_states.split(",") if s)
    return replace(sweep.Setup(), d_model=args.d_model, layers=args.layers, context=args.context, batch=args.batch,
                   steps=args.steps, sync_every=args.sync_every, rank=args.rank, omega=args.omega, clip=args.clip,
                   sync_states=states, threads=args.threads)


def wire_bytes() -> int:
    """Return the bytes this rank has handed to MPI in all collectives so far."""
    s = cw.stats()
    return sum(v.get("bytes", 0) for k, v in s.items() if k != "codecs" and isinstance(v, dict))


def run(method: str, corpus: Corpus, setup: sweep.Setup, args: argparse.Namespace, comm: cw.Communicator
        ) -> dict[str, Any]:
    """Train one method; return its curves, bytes, memory, time and diagnostics."""
    arm, lr = sweep.ARMS[method], args.lr[method]
    cfg = LMConfig(d_model=setup.d_model, layers=setup.layers, heads=setup.heads, context=setup.context)
    model = make_lm(cfg, seed=args.seed)
    opt = sweep.build_optimizer(arm, model, lr, setup)
    params = list(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: sweep.lr_factor(s, setup.steps, setup.warmup))
    gen = torch.Generator().manual_seed(1_000_003 * (args.seed + 1) + comm.rank)  # same batches for every method
    curve = [(0, sweep.val_loss(model, corpus, comm, setup.context), 0)]
    sent, train_s = 0, 0.0
    for step in range(1, setup.steps + 1):
        t0, b0 = time.perf_counter(), wire_bytes()
        x, y = corpus.batch("train", batch=setup.batch, context=setup.context, generator=gen)
        opt.zero_grad()
        model.loss(x, y).backward()
        sweep.optimizer_step(arm, opt, params, setup.clip)
        sched.step()
        sent += wire_bytes() - b0
        train_s += time.perf_counter() - t0
        if step % args.eval_every == 0 or step == setup.steps:
            curve.append((step, sweep.val_loss(model, corpus, comm, setup.context), sent))
    final = curve[-1][1]
    inner = opt.optimizer if isinstance(opt, hvd.DistributedOptimizer) else opt
    out = {"method": method, "label": LABELS[method], "lr": lr, "curve": curve, "final_val": final,
           "bytes_total": sent, "bytes_per_step": sent / setup.steps, "state_bytes": hvd.state_nbytes(inner),
           "wall_s": float(comm.allreduce(np.array([train_s]), "max")[0]), "diagnostics": []}
    if isinstance(opt, hvd.LoRDO):
        out["stats"] = opt.stats()
        out["projected"] = len(opt.projected_names)
        out["diagnostics"] = [{"step": d["step"], "similarity": float(np.mean(list(d["similarity"].values()))),
                               "min_similarity": float(np.min(list(d["similarity"].values()))),
                               "rank_over_r": float(np.mean(list(d["rank"].values()))) / setup.rank,
                               "max_rank": int(max(d["rank"].values()))}
                              for d in opt.diagnostics if d["similarity"]]  # none when no matrix exceeds --rank
    return out


def table(results: list[dict[str, Any]]) -> str:
    """Return the Markdown results table."""
    ddp = next((r for r in results if r["method"] == "ddp"), None)
    head = ("| method | final val loss (nats/byte) | vs DDP | bytes/step | DDP bytes ÷ | optimizer state | "
            "wall time |\n|---|---|---|---|---|---|---|")
    rows = []
    for r in results:
        rel = f"{100 * (r['final_val'] / ddp['final_val'] - 1):+.2f}%" if ddp else "–"
        ratio = f"{ddp['bytes_per_step'] / r['bytes_per_step']:.1f}×" if ddp and r["bytes_per_step"] else "–"
        rows.append(f"| {r['label']} | {r['final_val']:.4f} | {rel} | {r['bytes_per_step'] / 1e3:.1f} kB | {ratio} | "
                    f"{r['state_bytes'] / 2 ** 20:.2f} MiB | {r['wall_s']:.1f} s |")
    return "\n".join([head, *rows])


def plots(results: list[dict[str, Any]], out: str) -> list[str]:
    """Write loss.png, bytes.png and (with LoRDO runs) stagnation.png; return the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        steps, losses, _ = zip(*r["curve"])
        ax.plot(steps, losses, marker="o", ms=3, label=r["label"])
    ax.set(xlabel="step", ylabel="validation loss (nats/byte)", title="Validation loss at equal steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=120)
    names.append("loss.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        _, losses, sent = zip(*r["curve"])
        ax.plot(np.maximum(np.array(sent) / 2 ** 20, 1e-3), losses, marker="o", ms=3, label=r["label"])
    ax.set(xscale="log", xlabel="MiB handed to MPI by one rank (cumulative)", ylabel="validation loss",
           title="Loss against bytes on the wire")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bytes.png"), dpi=120)
    names.append("bytes.png")
    lordo = [r for r in results if r["diagnostics"]]
    if lordo:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for r in lordo:
            d = r["diagnostics"][1:]  # the first refresh compares with the bootstrap basis
            a1.plot([x["step"] for x in d], [x["similarity"] for x in d], marker="o", ms=3, label=r["label"])
            a2.plot([x["step"] for x in d], [x["rank_over_r"] for x in d], marker="o", ms=3, label=r["label"])
        a1.set(xlabel="step", ylabel="mean σ² of Q_newᵀ Q_old", title="Subspace similarity of consecutive projections",
               ylim=(0, 1.05))
        a2.axhline(1.0, color="grey", ls="--", lw=1, label="rank = r")
        a2.set(xlabel="step", ylabel="numerical rank of averaged Δ / r", title="Rank of the averaged pseudo-gradient")
        for a in (a1, a2):
            a.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "stagnation.png"), dpi=120)
        names.append("stagnation.png")
    plt.close("all")
    return names


def summary(results: list[dict[str, Any]], args: argparse.Namespace, setup: sweep.Setup, params: int, size: int,
            figures: list[str]) -> str:
    """Return the Markdown summary: what was run, the table, the checks, the figures."""
    by = {r["method"]: r for r in results}
    lrs = ",".join(f"{r['method']}={r['lr']:g}" for r in results)
    lines = [
        "# LoRDO vs DDP on a byte-level language model", "",
        f"Ran: `commwire run -np {size} python examples/lordo_lm.py --methods {args.methods} --lr {lrs} "
        f"--steps {setup.steps} --sync-every {setup.sync_every} --rank {setup.rank} --omega {setup.omega} "
        f"--d-model {setup.d_model} --layers {setup.layers} --context {setup.context} --batch {setup.batch} "
        f"--clip {setup.clip} --seed {args.seed} --sync-states '{args.sync_states}'`", "",
        f"- Model: TinyGPT, d_model={setup.d_model}, {setup.layers} layers, {setup.heads} heads, context "
        f"{setup.context}, {params:,} parameters, byte vocabulary; corpus: Python's pydoc_data topics (train/val split).",
        f"- {size} ranks, {setup.batch} sequences per rank per step, {setup.steps} steps for every method, one seed "
        f"({args.seed}); AdamW-style steps (betas (0.9, 0.95), weight decay {setup.weight_decay}), gradients clipped "
        f"to global norm {setup.clip}; peak LRs {lrs}: each method's best in `benchmarks/lordo.py` unless given "
        f"with --lr (that benchmark's table, mean ± std over 3 seeds, is the tuned comparison); "
        f"{int(100 * setup.warmup)}% warm-up then cosine to 10%.",
        f"- DiLoCo syncs every K={setup.sync_every} steps with a Nesterov outer step (lr {setup.outer_lr}, momentum "
        f"{setup.outer_momentum}); LoRDO every K steps with plain averaging, rank r={setup.rank}, ω={setup.omega}, "
        f"states averaged at a sync: {args.sync_states or 'none'}; low-rank DDP (GaLore-style LowRankAdam under "
        f"DistributedOptimizer) refreshes its basis every {setup.sync_every} steps from the averaged gradient.",
        "- Bytes: what this rank handed to MPI (commwire.stats()), divided by steps; LoRDO's include the one-time "
        "all-reduce of the first gradient that seeds the bases. Optimizer state: Adam moments, low-rank moments "
        "and bases, error-feedback buffers, reference weights and outer momentum.",
        "", table(results), "",
    ]
    ddp = by.get("ddp")
    if ddp and "lordo" in by:
        lo = by["lordo"]
        ratio = ddp["bytes_per_step"] / lo["bytes_per_step"]
        gap = lo["final_val"] / ddp["final_val"] - 1
        lines += ["## Checks (one seed)", "",
                  f"- LoRDO sends {ratio:.1f}× fewer bytes per step than DDP (target ≥ 10×): "
                  f"{'met' if ratio >= 10 else 'NOT met'}.",
                  f"- LoRDO's final validation loss is {100 * gap:+.2f}% vs DDP-Adam (target: at most 5% above): "
                  f"{'met' if gap <= 0.05 else 'NOT met'}."]
        if "lowrank-ddp" in by:
            lr = by["lowrank-ddp"]
            gap = lo["final_val"] / lr["final_val"] - 1
            lines.append(f"- vs low-rank DDP: {100 * gap:+.2f}% loss (target: at most 3% above: "
                         f"{'met' if gap <= 0.03 else 'NOT met'}) at "
                         f"{lr['bytes_per_step'] / lo['bytes_per_step']:.1f}× fewer bytes per step.")
        lines.append("")
    stag = [r for r in results if r["diagnostics"]]
    if stag:
        lines += ["## Stagnation (ω = 1)", "",
                  "| method | mean similarity of consecutive projections | min | max numerical rank of Δ (r = "
                  f"{setup.rank}) |", "|---|---|---|---|"]
        for r in stag:
            d = r["diagnostics"][1:]
            if d:
                lines.append(f"| {r['label']} | {np.mean([x['similarity'] for x in d]):.4f} | "
                             f"{min(x['min_similarity'] for x in d):.4f} | {max(x['max_rank'] for x in d)} |")
        lines.append("")
    lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the report (rank 0)."""
    args = parse(argv)
    torch.set_num_threads(args.threads)
    comm = cw.init()
    corpus = Corpus.load()
    setup = setup_of(args)
    cfg = LMConfig(d_model=setup.d_model, layers=setup.layers, context=setup.context, heads=setup.heads)
    params = sum(p.numel() for p in make_lm(cfg).parameters())
    results = []
    for method in args.methods.split(","):
        start = time.perf_counter()
        results.append(run(method, corpus, setup, args, comm))
        if comm.rank == 0:
            r = results[-1]
            print(f"{r['label']:>14}: val {r['final_val']:.4f}  {r['bytes_per_step'] / 1e3:9.1f} kB/step  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    if comm.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        figures = plots(results, args.out)
        text = summary(results, args, setup, params, comm.size, figures)
        with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as fh:
            fh.write(text)
        with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "params": params, "ranks": comm.size,
                       "results": results}, fh, indent=1)
        print(text)


if __name__ == "__main__":
    main()
