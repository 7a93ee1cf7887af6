"""Compare DDP-Adam, low-rank DDP, DiLoCo, LoRDO and LoRDO(ω = 1) on a byte-level language model.

Every method trains the same TinyGPT (``commwire.bench.lm``) from the same
initial weights on the same per-rank batches of the Python documentation text
for the same number of steps, in one MPI job. Reported per method: final
validation loss (nats/byte), bytes handed to MPI per step (``commwire.stats()``,
this rank), its ratio to DDP, optimizer-state memory and training wall time.
For the two LoRDO runs the stagnation diagnostics are plotted: at every sync
the subspace similarity of consecutive projections (1 = same subspace) and
the numerical rank of the averaged pseudo-gradient relative to r.

Writes into ``--out`` (default reports/lordo/): loss.png, bytes.png,
stagnation.png, summary.md, results.json; prints the table.

Run:
    commwire run -np 4 python examples/lordo_lm.py
    commwire run -np 4 python examples/lordo_lm.py --steps 256 --methods ddp,lordo
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

import numpy as np
import torch

import commwire as cw
import commwire.torch as hvd
from commwire.bench.lm import Corpus, LMConfig, evaluate, make_lm

METHODS = ("ddp", "lowrank-ddp", "diloco", "lordo", "lordo-omega1")
LABELS = {"ddp": "DDP-Adam", "lowrank-ddp": "low-rank DDP", "diloco": "DiLoCo",
          "lordo": "LoRDO", "lordo-omega1": "LoRDO ω=1"}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=384, help="training steps per method (multiple of --sync-every)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list from {','.join(METHODS)}")
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak LR of the full-rank Adam methods (DDP, DiLoCo)")
    p.add_argument("--lowrank-lr", type=float, default=3e-3,
                   help="peak LR of the low-rank methods (low-rank DDP, LoRDO): their updates are confined "
                        "to r directions per matrix and prefer a larger LR, as in GaLore")
    p.add_argument("--warmup", type=float, default=0.05, help="fraction of steps of linear LR warm-up")
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--sync-every", type=int, default=16, help="K for DiLoCo and LoRDO; basis refresh of low-rank DDP")
    p.add_argument("--rank", type=int, default=24, help="r for the low-rank methods")
    p.add_argument("--omega", type=float, default=0.97)
    p.add_argument("--sync-states", default="", help="LoRDO states averaged at a sync, e.g. moments,error_feedback")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer LR of DiLoCo and LoRDO (Nesterov)")
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--codec", default="none", help="wire format of the pseudo-gradients, e.g. fp8-e4m3")
    p.add_argument("--eval-every", type=int, default=64, help="steps between validation losses")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches per rank (of 32 windows)")
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


def build(method: str, model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Return the optimizer of ``method`` for ``model``."""
    named = list(model.named_parameters())
    adam = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": args.weight_decay}
    if method in ("lowrank-ddp", "lordo", "lordo-omega1"):
        adam["lr"] = args.lowrank_lr
    outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    codec = None if args.codec == "none" else args.codec
    if method == "ddp":
        return hvd.DistributedOptimizer(torch.optim.AdamW([p for _, p in named], **adam), named_parameters=named)
    if method == "lowrank-ddp":
        inner = hvd.LowRankAdam([p for _, p in named], rank=args.rank, refresh_every=args.sync_every, **adam)
        return hvd.DistributedOptimizer(inner, named_parameters=named)
    if method == "diloco":
        return hvd.DiLoCo(named, sync_every=args.sync_every, codec=codec, **outer, **adam)
    omega = 1.0 if method == "lordo-omega1" else args.omega
    states = tuple(s for s in args.sync_states.split(",") if s)
    return hvd.LoRDO(named, rank=args.rank, sync_every=args.sync_every, omega=omega, sync_states=states,
                     codec=codec, **outer, **adam)


def lr_factor(step: int, total: int, warmup: float) -> float:
    """Return the LR multiplier: linear warm-up, then cosine decay to 10%."""
    w = max(1, int(warmup * total))
    if step < w:
        return (step + 1) / w
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, total - w)))


def val_loss(model: torch.nn.Module, corpus: Corpus, comm: cw.Communicator, batches: int) -> float:
    """Return the validation loss averaged over ranks (each rank evaluates its own fixed windows)."""
    mine = evaluate(model, corpus, batches=batches, seed=1234 + comm.rank)
    return float(comm.allreduce(np.array([mine]), "avg")[0])


def wire_bytes() -> int:
    """Return the bytes this rank has handed to MPI in all-reduces so far."""
    s = cw.stats()
    return sum(s.get(op, {}).get("bytes", 0) for op in ("allreduce", "compressed_allreduce"))


def run(method: str, corpus: Corpus, cfg: LMConfig, args: argparse.Namespace, comm: cw.Communicator
        ) -> dict[str, Any]:
    """Train one method; return its curves, bytes, memory, time and diagnostics."""
    model = make_lm(cfg, seed=0)
    opt = build(method, model, args)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps, args.warmup))
    gen = torch.Generator().manual_seed(10_000 + comm.rank)  # same batches for every method
    curve = [(0, val_loss(model, corpus, comm, args.eval_batches), 0)]
    sent, train_s = 0, 0.0
    for step in range(1, args.steps + 1):
        t0, b0 = time.perf_counter(), wire_bytes()
        x, y = corpus.batch("train", batch=args.batch, context=cfg.context, generator=gen)
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
        sched.step()
        sent += wire_bytes() - b0
        train_s += time.perf_counter() - t0
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, val_loss(model, corpus, comm, args.eval_batches), sent))
    final = val_loss(model, corpus, comm, 4 * args.eval_batches)
    inner = opt.optimizer if isinstance(opt, hvd.DistributedOptimizer) else opt
    out = {"method": method, "label": LABELS[method], "curve": curve, "final_val": final,
           "bytes_total": sent, "bytes_per_step": sent / args.steps, "state_bytes": hvd.state_nbytes(inner),
           "wall_s": float(comm.allreduce(np.array([train_s]), "max")[0]), "diagnostics": []}
    if isinstance(opt, hvd.LoRDO):
        out["bytes_per_sync_formula"] = opt.bytes_per_sync
        out["projected"] = len(opt.projected_names)
        out["diagnostics"] = [{"step": d["step"], "similarity": float(np.mean(list(d["similarity"].values()))),
                               "min_similarity": float(np.min(list(d["similarity"].values()))),
                               "rank_over_r": float(np.mean(list(d["rank"].values()))) / args.rank,
                               "max_rank": int(max(d["rank"].values()))} for d in opt.diagnostics]
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


def summary(results: list[dict[str, Any]], args: argparse.Namespace, cfg: LMConfig, params: int, size: int,
            figures: list[str]) -> str:
    """Return the Markdown summary: what was run, the table, the acceptance checks, the figures."""
    by = {r["method"]: r for r in results}
    lines = [
        "# LoRDO vs DDP on a byte-level language model", "",
        f"Ran: `commwire run -np {size} python examples/lordo_lm.py "
        f"--steps {args.steps} --sync-every {args.sync_every} --rank {args.rank} --omega {args.omega} "
        f"--d-model {args.d_model} --layers {args.layers} --context {args.context} --batch {args.batch} "
        f"--lr {args.lr} --lowrank-lr {args.lowrank_lr} --sync-states '{args.sync_states}' --codec {args.codec}`", "",
        f"- Model: TinyGPT, d_model={cfg.d_model}, {cfg.layers} layers, {cfg.heads} heads, context {cfg.context}, "
        f"{params:,} parameters, byte vocabulary; corpus: Python's pydoc_data topics (train/val split).",
        f"- {size} ranks, {args.batch} sequences per rank per step, {args.steps} steps for every method, "
        f"AdamW-style steps (betas (0.9, 0.95), weight decay {args.weight_decay}); peak LR {args.lr} for the "
        f"full-rank methods (DDP-Adam, DiLoCo) and {args.lowrank_lr} for the low-rank ones (low-rank DDP, LoRDO), "
        f"each family's best of a small sweep; {int(100 * args.warmup)}% warm-up then cosine to 10%.",
        f"- DiLoCo and LoRDO sync every K={args.sync_every} steps with a Nesterov outer step "
        f"(lr {args.outer_lr}, momentum {args.outer_momentum}); LoRDO rank r={args.rank}, ω={args.omega}, "
        f"states averaged at a sync: {args.sync_states or 'none'}; low-rank DDP (GaLore-style LowRankAdam under "
        f"DistributedOptimizer) refreshes its basis every {args.sync_every} steps from the averaged gradient.",
        "- Bytes: what this rank handed to MPI in all-reduces (commwire.stats()), divided by steps; LoRDO's "
        "include the one-time all-reduce of the first gradient that seeds the bases. Optimizer state: Adam "
        "moments, low-rank moments and bases, error-feedback buffers, reference weights and outer momentum.",
        "", table(results), "",
    ]
    ddp = by.get("ddp")
    if ddp and "lordo" in by:
        lo = by["lordo"]
        ratio = ddp["bytes_per_step"] / lo["bytes_per_step"]
        gap = lo["final_val"] / ddp["final_val"] - 1
        lines += ["## Acceptance", "",
                  f"- LoRDO sends {ratio:.1f}× fewer bytes per step than DDP (target ≥ 10×): "
                  f"{'met' if ratio >= 10 else 'NOT met'}.",
                  f"- LoRDO's final validation loss is {100 * gap:+.2f}% vs DDP-Adam (target: at most 3% above): "
                  f"{'met' if gap <= 0.03 else 'NOT met'}."]
        if "lowrank-ddp" in by:
            lr = by["lowrank-ddp"]
            lines.append(f"- vs low-rank DDP: {100 * (lo['final_val'] / lr['final_val'] - 1):+.2f}% loss at "
                         f"{lr['bytes_per_step'] / lo['bytes_per_step']:.1f}× fewer bytes per step.")
        lines.append("")
    stag = [r for r in results if r["diagnostics"]]
    if stag:
        lines += ["## Stagnation (ω = 1)", "",
                  "| method | mean similarity of consecutive projections | min | max numerical rank of Δ (r = "
                  f"{args.rank}) |", "|---|---|---|---|"]
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
    cfg = LMConfig(d_model=args.d_model, layers=args.layers, context=args.context, heads=4)
    params = sum(p.numel() for p in make_lm(cfg).parameters())
    results = []
    for method in args.methods.split(","):
        start = time.perf_counter()
        results.append(run(method, corpus, cfg, args, comm))
        if comm.rank == 0:
            r = results[-1]
            print(f"{r['label']:>14}: val {r['final_val']:.4f}  {r['bytes_per_step'] / 1e3:9.1f} kB/step  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    if comm.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        figures = plots(results, args.out)
        text = summary(results, args, cfg, params, comm.size, figures)
        with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as fh:
            fh.write(text)
        with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "params": params, "ranks": comm.size, "results": results}, fh, indent=1)
        print(text)


if __name__ == "__main__":
    main()
