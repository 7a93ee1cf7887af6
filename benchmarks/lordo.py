"""Sweep LoRDO and its baselines over one learning-rate grid and several seeds on a byte-level GPT.

Every arm trains the same TinyGPT (``commwire.bench.lm``) for the same steps
on the same per-rank batches, with the same LR schedule (linear warm-up, then
cosine to 10%) and the same gradient clipping (global norm ρ = 0.5, the
max_norm of the LoRDO authors' runs): DDP-Adam and low-rank DDP clip the
averaged gradient, DiLoCo and LoRDO their local one. Arms (``ARMS``):

- ``ddp``: AdamW under ``DistributedOptimizer`` (every gradient, every step);
- ``lowrank-ddp``: ``LowRankAdam`` under ``DistributedOptimizer`` (GaLore-style,
  basis from the averaged gradient every K steps);
- ``lordo``, ``lordo-omega1`` (ω = 1: pure global-projection low-rank local
  Adam, the variant that stagnates), ``diloco``: one sync every K steps;
- ``streaming-diloco`` (off by default): Streaming DiLoCo's setting, 4 fragments
  taking turns (each syncs once per K steps, a quarter of the model at a time),
  each in flight for τ = 1 step, α = 0.5; ``streaming-diloco-nvfp4`` also sends
  its pseudo-gradients in NVFP4 (the paper's 4-bit outer gradients); its ablations
  ``diloco-fragments`` (the 4 fragments, blocking, no mixing) and ``diloco-delay-mix``
  (the whole model in flight for a step, α = 0.5); ``diloco-outer-half``: DiLoCo with half
  the outer learning rate (0.35);
- extra LoRDO variants, off by default: ``lordo-broadcast`` (QH denominator
  broadcast instead of scalar), ``lordo-ef-none``, ``lordo-ef-lowrank``
  (optimizer state O(r(m+n))), ``lordo-warmup`` (the authors' DDP warm-up,
  then betas (0.999, 0.999), moments reset, LR × 0.5), ``lordo-fp8-k4`` /
  ``lordo-fp8-k8`` (LoRDO syncing 4× / 2× as often with ef+FP8 pseudo-gradients,
  without / with bf16 moments: about the bytes of K=16 in FP32), and the
  diagnostics ``lordo-k1`` (LoRDO syncing every step: what is left of its gap
  to low-rank DDP without local steps) and ``lordo-ddp`` (LoRDO's optimizer fed
  DDP's averaged gradient every step: its gap to low-rank DDP without separate
  per-rank optimizer states).

Each arm runs every LR of the grid with every seed (seed = initial weights and
data order); its best LR is the one with the lowest validation loss averaged
over seeds. The validation loss is the mean next-byte cross-entropy over the
whole validation split (non-overlapping windows shared out over the ranks, so
it is exact and the same for every run). Bytes per step are measured: what
``commwire.stats()`` counts over the training steps (all collectives of this
rank), divided by the steps. For the LoRDO arms the stagnation diagnostics are
reported: subspace similarity of consecutive projections and the numerical
rank of the averaged pseudo-gradient relative to r.

Run from a checkout of the repository: ``commwire run -np 4 python benchmarks/lordo.py``
(``--quick`` for a smoke run; ``--json FILE`` keeps every run's row;
``python benchmarks/lordo.py --report A.json B.json`` renders the report of earlier sweeps).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ARMS", "DEFAULT_ARMS", "LRS", "Setup", "build_optimizer", "build_parser", "format_report", "lr_factor",
           "main", "merged_report", "optimizer_step", "run_sweep", "summarize", "train_arm", "val_loss"]


@dataclass(frozen=True)
class Arm:
    """One method of the sweep: a label, an optimizer family and its fixed settings."""

    label: str
    family: str
    """"ddp", "lowrank-ddp", "diloco" or "lordo"."""
    options: dict[str, Any] = field(default_factory=dict)
    """LoRDO or DiLoCo keyword arguments (for the "lordo" and "diloco" families)."""


ARMS = {
    "ddp": Arm("DDP-Adam", "ddp"),
    "lowrank-ddp": Arm("low-rank DDP", "lowrank-ddp"),
    "lordo": Arm("LoRDO", "lordo"),
    "lordo-omega1": Arm("LoRDO ω=1", "lordo", {"omega": 1.0}),
    "diloco": Arm("DiLoCo", "diloco"),
    "streaming-diloco": Arm("Streaming DiLoCo P=4 τ=1 α=0.5", "diloco",
                            {"fragments": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}),
    "streaming-diloco-nvfp4": Arm("Streaming DiLoCo P=4 τ=1 α=0.5, NVFP4 Δ", "diloco",
                                  {"fragments": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5,
                                   "codec": "nvfp4"}),
    # Ablations of Streaming DiLoCo: the fragments alone (blocking, no mixing), the delay and mixing alone.
    "diloco-fragments": Arm("DiLoCo in 4 fragments (τ=0, α=0)", "diloco", {"fragments": 4}),
    "diloco-delay-mix": Arm("DiLoCo, whole model, τ=1 α=0.5", "diloco",
                            {"fragment_sync_delay": 1, "fragment_update_alpha": 0.5}),
    # Is α's gain an outer step's? α = 0.5 after a plain outer step halves how far the weights move.
    "diloco-outer-half": Arm("DiLoCo, outer lr 0.35", "diloco", {"outer_lr": 0.35}),
    "lordo-broadcast": Arm("LoRDO, broadcast D", "lordo", {"qh_denominator": "broadcast"}),
    "lordo-ef-none": Arm("LoRDO, no EF", "lordo", {"error_feedback": "none"}),
    "lordo-ef-lowrank": Arm("LoRDO, rank-r EF", "lordo", {"error_feedback": "lowrank"}),
    "lordo-warmup": Arm("LoRDO, DDP warm-up + switch", "lordo",
                        {"switch_betas": (0.999, 0.999), "switch_reset_moments": True, "switch_lr_scale": 0.5}),
    # LoRDO with commwire's codecs on the wire: FP8 pseudo-gradients (error feedback across syncs) buy
    # more frequent syncs for the same bytes. K is the arm's own; every other setting is the setup's.
    "lordo-fp8-k4": Arm("LoRDO K=4, ef+FP8 Δ, no state sync", "lordo",
                        {"sync_every": 4, "codec": "ef+fp8-e4m3", "sync_states": ()}),
    "lordo-fp8-k8": Arm("LoRDO K=8, ef+FP8 Δ, bf16 moments", "lordo",
                        {"sync_every": 8, "codec": "ef+fp8-e4m3", "state_codec": "bf16"}),
    # E5M2 for the moments: the second moment spans many binades, and E4M3's narrower range would
    # flush its small entries (then m/√v blows up).
    "lordo-fp8-k4-fp8m": Arm("LoRDO K=4, ef+FP8 Δ, E5M2 moments", "lordo",
                             {"sync_every": 4, "codec": "ef+fp8-e4m3", "state_codec": "fp8-e5m2"}),
    # A diagnostic, not a candidate (it syncs every step): how much of LoRDO's gap to low-rank DDP is
    # locality.
    "lordo-k1": Arm("LoRDO K=1 (diagnostic)", "lordo", {"sync_every": 1}),
    # A diagnostic too: LoRDO's own optimizer (Δ basis, QH term, error feedback, clipping) fed DDP's
    # averaged gradient at every step (its warm-up, never ended). Against low-rank DDP it isolates the
    # optimizer; against LoRDO, what the ranks' separate optimizer states cost.
    "lordo-ddp": Arm("LoRDO optimizer on DDP gradients (diagnostic)", "lordo", {"warmup_steps": "run"}),
}
DEFAULT_ARMS = ("ddp", "lowrank-ddp", "lordo", "lordo-omega1", "diloco")
LRS = (1.5e-3, 3e-3, 6e-3, 1.2e-2, 2.4e-2)
"""The default learning-rate grid, shared by every arm (the report marks any arm whose best LR is at an
edge of the grid: the grid should then be extended)."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Everything but the arm, LR and seed: model, data, budget, schedule, shared hyperparameters."""

    d_model: int = 96
    layers: int = 2
    heads: int = 4
    context: int = 64
    batch: int = 16
    """Sequences per rank and step."""
    steps: int = 256
    warmup: float = 0.05
    """Fraction of the steps with a linear LR warm-up (then cosine to 10%)."""
    sync_every: int = 16
    """K: local steps per sync (DiLoCo, LoRDO); basis refresh period of low-rank DDP."""
    rank: int = 24
    omega: float = 0.97
    clip: float = 0.5
    weight_decay: float = 1e-5
    outer_lr: float = 0.7
    """DiLoCo's outer step (Nesterov): lr 0.7, momentum 0.9."""
    outer_momentum: float = 0.9
    lordo_outer_lr: float = 1.0
    """LoRDO's outer step: plain averaging of the pseudo-gradients."""
    lordo_outer_momentum: float = 0.0
    sync_states: tuple[str, ...] = ("moments",)
    """LoRDO states averaged at a sync: the optimizer's default (low-rank moments, as the authors' runs)."""
    warmup_steps: int = 32
    """DDP warm-up of the lordo-warmup arm (a multiple of sync_every)."""
    threads: int = 1


# ------------------------------------------------------------------ one run
def _sent() -> int:
    """Return the bytes this rank has handed to MPI in all collectives so far."""
    import commwire as cw

    return sum(v.get("bytes", 0) for k, v in cw.stats().items() if k != "codecs" and isinstance(v, dict))


def lr_factor(step: int, total: int, warmup: float) -> float:
    """Return the LR multiplier at ``step`` of ``total``: linear warm-up (``warmup`` of the steps), cosine to 10%."""
    w = max(1, int(warmup * total))
    if step < w:
        return (step + 1) / w
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, total - w)))


def build_optimizer(arm: Arm, model: Any, lr: float, setup: Setup) -> Any:
    """Return the optimizer of ``arm`` for ``model`` at peak LR ``lr``."""
    import torch

    import commwire.torch as hvd

    named = list(model.named_parameters())
    adam = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": setup.weight_decay}
    outer = {"outer_lr": setup.outer_lr, "outer_momentum": setup.outer_momentum}
    lordo_outer = {"outer_lr": setup.lordo_outer_lr, "outer_momentum": setup.lordo_outer_momentum}
    if arm.family == "ddp":
        return hvd.DistributedOptimizer(torch.optim.AdamW([p for _, p in named], **adam), named_parameters=named)
    if arm.family == "lowrank-ddp":
        inner = hvd.LowRankAdam([p for _, p in named], rank=setup.rank, refresh_every=setup.sync_every, **adam)
        return hvd.DistributedOptimizer(inner, named_parameters=named)
    if arm.family == "diloco":
        return hvd.DiLoCo(named, sync_every=setup.sync_every, **{**outer, **adam, **arm.options})
    options = {"omega": setup.omega, "clip": setup.clip, "sync_states": setup.sync_states,
               "sync_every": setup.sync_every, **arm.options}
    if "switch_betas" in options:
        options["warmup_steps"] = setup.warmup_steps
    if options.get("warmup_steps") == "run":  # the whole run, rounded up to whole local periods
        options["warmup_steps"] = -(-setup.steps // options["sync_every"]) * options["sync_every"]
    return hvd.LoRDO(named, rank=setup.rank, **{**lordo_outer, **adam, **options})


def optimizer_step(arm: Arm, opt: Any, params: list[Any], clip: float) -> None:
    """Clip the gradient the arm uses to global norm ``clip`` and take one step."""
    import torch

    if arm.family in ("ddp", "lowrank-ddp"):
        opt.synchronize()  # clip the averaged gradient, as DDP does
        torch.nn.utils.clip_grad_norm_(params, clip)
        with opt.skip_synchronize():
            opt.step()
    elif arm.family == "diloco":
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
    else:
        opt.step()  # LoRDO clips its local gradient itself (clip=ρ)


def val_loss(model: Any, corpus: Any, comm: Any, context: int) -> float:
    """Return the mean next-byte loss over the whole validation split (windows shared out over ranks)."""
    import torch

    data = corpus.val
    windows = np.arange(comm.rank, (data.size - 1) // context, comm.size)
    total = count = 0.0
    was = model.training
    model.eval()
    with torch.no_grad():
        for chunk in np.array_split(windows, max(1, len(windows) // 64)):
            if not len(chunk):
                continue
            idx = chunk[:, None] * context + np.arange(context + 1)[None, :]
            tokens = torch.from_numpy(data[idx].astype(np.int64))
            logits = model(tokens[:, :-1])
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                             tokens[:, 1:].reshape(-1), reduction="sum"))
            count += tokens[:, 1:].numel()
    model.train(was)
    summed = comm.allreduce(np.array([total, count]), "sum")
    return float(summed[0] / summed[1])


def _stagnation(diagnostics: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    later = diagnostics[1:]  # the first refresh compares with the bootstrap basis
    sims = [s for d in later for s in d["similarity"].values()]
    ranks = [r for d in later for r in d["rank"].values()]
    if not sims:
        return {}
    return {"similarity": float(np.mean(sims)), "min_similarity": float(np.min(sims)),
            "max_rank": int(max(ranks)), "min_rank": int(min(ranks)),
            "rank_le_r": float(np.mean([r <= rank for r in ranks])), "refreshes": len(later)}


def train_arm(name: str, lr: float, seed: int, setup: Setup, corpus: Any, comm: Any) -> dict[str, Any]:
    """Train arm ``name`` at ``lr`` with ``seed``; return its validation loss, bytes, memory and diagnostics."""
    import torch

    import commwire.torch as hvd

    from commwire.bench.lm import LMConfig, make_lm

    arm = ARMS[name]
    cfg = LMConfig(d_model=setup.d_model, layers=setup.layers, heads=setup.heads, context=setup.context)
    model = make_lm(cfg, seed=seed)
    opt = build_optimizer(arm, model, lr, setup)
    params = list(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, setup.steps, setup.warmup))
    gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + comm.rank)
    comm.barrier()
    start, before = time.perf_counter(), _sent()
    for _ in range(setup.steps):
        x, y = corpus.batch("train", batch=setup.batch, context=setup.context, generator=gen)
        opt.zero_grad()
        model.loss(x, y).backward()
        optimizer_step(arm, opt, params, setup.clip)
        sched.step()
    sent, wall = _sent() - before, time.perf_counter() - start
    inner = opt.optimizer if isinstance(opt, hvd.DistributedOptimizer) else opt
    row = {"arm": name, "label": arm.label, "lr": lr, "seed": seed, "val": val_loss(model, corpus, comm, setup.context),
           "bytes_per_step": sent / setup.steps, "state_bytes": hvd.state_nbytes(inner),
           "wall_s": float(comm.allreduce(np.array([wall]), "max")[0]),
           "largest_sync_bytes": getattr(inner, "bytes_per_sync", sent / setup.steps),
           "finite": bool(all(torch.isfinite(p).all() for p in params))}
    if isinstance(opt, hvd.LoRDO):
        row["stagnation"] = _stagnation(opt.diagnostics, setup.rank)
        row["lordo_bytes"] = opt.stats()["bytes"]
        row["lordo_memory"] = opt.stats()["memory"]
    return row


# ----------------------------------------------------------------- the sweep
def run_sweep(arms: tuple[str, ...], lrs: tuple[float, ...], seeds: tuple[int, ...], setup: Setup, *,
              json_path: str | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """Run every (arm, lr, seed); return the rows (rank 0 appends each to ``json_path`` as it finishes)."""
    import torch

    import commwire as cw

    from commwire.bench.lm import Corpus

    torch.set_num_threads(setup.threads)
    comm = cw.init()
    corpus = Corpus.load()
    rows = []
    total, began = len(arms) * len(lrs) * len(seeds), time.perf_counter()
    for name in arms:
        for lr in lrs:
            for seed in seeds:
                rows.append(train_arm(name, lr, seed, setup, corpus, comm))
                r = rows[-1]
                if comm.rank == 0:
                    if progress:
                        print(f"lordo: [{len(rows)}/{total}] {r['label']} lr={lr:g} seed={seed}: val "
                              f"{r['val']:.4f}, {r['bytes_per_step'] / 1e3:.1f} kB/step, {r['wall_s']:.0f} s "
                              f"({time.perf_counter() - began:.0f} s so far)", file=sys.stderr, flush=True)
                    if json_path:
                        with open(json_path, "w", encoding="utf-8") as fh:
                            json.dump({"setup": _setup_dict(setup), "ranks": comm.size, "rows": rows}, fh, indent=1)
    return rows


def _setup_dict(setup: Setup) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(setup)


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Return, per arm: mean ± std per LR over seeds, the best LR (lowest mean), its bytes and memory."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == name]
        grid = sorted({r["lr"] for r in mine})
        per_lr = {}
        for lr in grid:
            vals = np.array([r["val"] for r in mine if r["lr"] == lr])
            vals = np.where(np.isfinite(vals), vals, np.inf)
            per_lr[lr] = {"mean": float(vals.mean()), "std": float(vals.std(ddof=1)) if len(vals) > 1 else 0.0,
                          "n": int(len(vals))}
        best = min(grid, key=lambda lr: per_lr[lr]["mean"])
        at_best = [r for r in mine if r["lr"] == best]
        out[name] = {"label": mine[0]["label"], "grid": grid, "per_lr": per_lr, "best_lr": best,
                     **per_lr[best], "edge": len(grid) > 1 and best in (grid[0], grid[-1]),
                     "bytes_per_step": float(np.mean([r["bytes_per_step"] for r in at_best])),
                     "state_bytes": int(at_best[0]["state_bytes"]),
                     "largest_sync_bytes": float(max(r.get("largest_sync_bytes", 0.0) for r in at_best)),
                     "wall_s": float(np.mean([r["wall_s"] for r in at_best]))}
        stag = [r["stagnation"] for r in at_best if r.get("stagnation")]
        if stag:
            out[name]["stagnation"] = {
                "similarity": float(np.mean([s["similarity"] for s in stag])),
                "min_similarity": float(min(s["min_similarity"] for s in stag)),
                "max_rank": int(max(s["max_rank"] for s in stag)), "min_rank": int(min(s["min_rank"] for s in stag)),
                "rank_le_r": float(np.mean([s["rank_le_r"] for s in stag]))}
    return out


def _pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.2f}%"


def format_report(summary: dict[str, dict[str, Any]], setup: Setup, ranks: int, seeds: tuple[int, ...]) -> str:
    """Render the sweep as Markdown: the tuned table, the per-LR grid, stagnation, the acceptance checks."""
    ddp, low = summary.get("ddp"), summary.get("lowrank-ddp")
    lines = [f"{ranks} ranks; TinyGPT d_model={setup.d_model}, {setup.layers} layers, context {setup.context}, "
             f"batch {setup.batch}/rank; {setup.steps} steps; K={setup.sync_every}, r={setup.rank}, "
             f"ω={setup.omega}, clip ρ={setup.clip}; seeds {list(seeds)}; validation loss in nats/byte "
             "(mean ± std over seeds at each arm's best LR)", "",
             "| arm | best lr | val loss | vs DDP-Adam | vs low-rank DDP | bytes/step | DDP bytes ÷ | "
             "largest sync | optimizer state | s/run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary.values():
        edge = " (grid edge)" if s["edge"] else ""
        ratio = f"{ddp['bytes_per_step'] / s['bytes_per_step']:.1f}×" if ddp and s["bytes_per_step"] else "–"
        lines.append(f"| {s['label']} | {s['best_lr']:g}{edge} | {s['mean']:.4f} ± {s['std']:.4f} | "
                     f"{_pct(s['mean'], ddp['mean']) if ddp else '–'} | "
                     f"{_pct(s['mean'], low['mean']) if low else '–'} | "
                     f"{s['bytes_per_step'] / 1e3:.1f} kB | {ratio} | {s['largest_sync_bytes'] / 1e3:.1f} kB | "
                     f"{s['state_bytes'] / 2 ** 20:.2f} MiB | "
                     f"{s['wall_s']:.1f} |")
    grid = sorted({lr for s in summary.values() for lr in s["grid"]})
    lines += ["", "Validation loss per learning rate (mean ± std over seeds):", "",
              "| arm | " + " | ".join(f"lr {lr:g}" for lr in grid) + " |", "|---|" + "---|" * len(grid)]
    for s in summary.values():
        cells = [f"{s['per_lr'][lr]['mean']:.4f} ± {s['per_lr'][lr]['std']:.4f}" if lr in s["per_lr"] else "–"
                 for lr in grid]
        lines.append(f"| {s['label']} | " + " | ".join(cells) + " |")
    stag = {k: s for k, s in summary.items() if "stagnation" in s}
    if stag:
        lines += ["", f"Stagnation at the best LR (refreshes after the first; r = {setup.rank}):", "",
                  "| arm | mean similarity of consecutive projections | min | numerical rank of Δ (min–max) | "
                  "refreshes with rank ≤ r |", "|---|---|---|---|---|"]
        for s in stag.values():
            t = s["stagnation"]
            lines.append(f"| {s['label']} | {t['similarity']:.4f} | {t['min_similarity']:.4f} | "
                         f"{t['min_rank']}–{t['max_rank']} | {100 * t['rank_le_r']:.0f}% |")
    lo = summary.get("lordo")
    if lo and ddp:
        ratio = ddp["bytes_per_step"] / lo["bytes_per_step"]
        lines += ["", "Acceptance:", "",
                  f"- LoRDO vs DDP-Adam: {_pct(lo['mean'], ddp['mean'])} (target ≤ +5%): "
                  f"{'met' if lo['mean'] <= 1.05 * ddp['mean'] else 'NOT met'}",
                  f"- bytes/step: {ratio:.1f}× fewer than DDP (target ≥ 10×): {'met' if ratio >= 10 else 'NOT met'}"]
        if low:
            lines.insert(-1, f"- LoRDO vs low-rank DDP: {_pct(lo['mean'], low['mean'])} (target ≤ +3%): "
                             f"{'met' if lo['mean'] <= 1.03 * low['mean'] else 'NOT met'}")
        om = summary.get("lordo-omega1", {}).get("stagnation")
        if om:
            ok = om["min_similarity"] > 1 - 1e-3 and om["max_rank"] <= setup.rank
            lines.append(f"- ω=1 stagnates (similarity ≈ 1, rank ≤ r at every refresh): "
                         f"min similarity {om['min_similarity']:.5f}, max rank {om['max_rank']}: "
                         f"{'shown' if ok else 'NOT shown'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- CLI
QUICK = {"d_model": 32, "layers": 1, "heads": 2, "context": 32, "batch": 4, "steps": 32, "sync_every": 8,
         "rank": 4, "warmup_steps": 8}


def _arms(text: str) -> tuple[str, ...]:
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(ARMS)}")
    return arms


def _lrs(text: str) -> tuple[float, ...]:
    try:
        lrs = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        lrs = ()
    if not lrs or min(lrs) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive comma-separated numbers, e.g. 1e-3,2e-3")
    return lrs


def merged_report(paths: list[str]) -> str:
    """Render the report of the rows in several ``--json`` files; refuse files whose setups differ.

    Rows of the same (arm, lr, seed) in two files are refused too: a seed counted twice would
    shrink the reported spread.
    """
    setups, rows, seen = [], [], {}
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        setups.append((path, data["setup"], data["ranks"]))
        for row in data["rows"]:
            key = (row["arm"], row["lr"], row["seed"])
            if key in seen:
                raise ValueError(f"{path}: arm {key[0]!r}, lr {key[1]:g}, seed {key[2]} is also in {seen[key]}; "
                                 "merge files that ran different learning rates, arms or seeds")
            seen[key] = path
            rows.append(row)
    first_path, first, ranks = setups[0]
    for path, setup, n in setups[1:]:
        if setup != first or n != ranks:
            diff = sorted(k for k in set(setup) | set(first) if setup.get(k) != first.get(k))
            raise ValueError(f"{path} ran a different setup than {first_path} (differs in "
                             f"{diff or ['ranks']}); only sweeps of the same setup can be merged")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in first.items()}
    seeds = tuple(sorted({r["seed"] for r in rows}))
    return format_report(summarize(rows), Setup(**fields), ranks, seeds)


def _publish(report: str, out: str | None) -> None:
    """Print the Markdown report; also write it to ``out`` if given."""
    print(report, flush=True)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(report + "\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``python benchmarks/lordo.py``."""
    p = argparse.ArgumentParser(prog="python benchmarks/lordo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", type=_arms, default=DEFAULT_ARMS, help=f"comma list from {', '.join(ARMS)} "
                   f"(default {','.join(DEFAULT_ARMS)})")
    p.add_argument("--lrs", type=_lrs, default=None, help="learning-rate grid shared by every arm "
                   f"(default {','.join(map(str, LRS))}; 2e-3,4e-3 with --quick)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per (arm, lr): 0, 1, ... (default 3; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny model, 32 steps, 2 LRs, 2 seeds: a smoke test")
    for name, default in Setup.__dataclass_fields__.items():
        if name in ("sync_states",):
            continue
        value = default.default
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None,
                       help=f"default {QUICK.get(name, value)} with --quick, else {value}" if name in QUICK
                       else f"default {value}")
    p.add_argument("--sync-states", default="moments", help="LoRDO states averaged at a sync (default moments, "
                   "LoRDO's own default; '' for none; moments,error_feedback adds the full EF buffers)")
    p.add_argument("--json", help="write every run's row (and the setup) to this JSON file as the sweep goes")
    p.add_argument("--out", help="also write the Markdown report to this file")
    p.add_argument("--report", nargs="+", metavar="JSON",
                   help="run nothing: render the report from these --json files of earlier sweeps with the "
                        "same setup and ranks (e.g. a second run that extends the LR grid)")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the sweep, print the report on rank 0."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.report:
        try:
            report = merged_report(args.report)
        except (OSError, ValueError, KeyError) as exc:
            p.error(str(exc))
        _publish(report, args.out)
        return
    arms = args.arms
    lrs = args.lrs if args.lrs is not None else (2e-3, 4e-3) if args.quick else LRS
    seeds = args.seeds if args.seeds is not None else 2 if args.quick else 3
    if seeds < 1:
        p.error(f"--seeds {seeds} must be >= 1")
    fields = {k: getattr(args, k) for k in Setup.__dataclass_fields__ if k != "sync_states"
              and getattr(args, k) is not None}
    fields = {**(QUICK if args.quick else {}), **fields}
    states = tuple(s for s in args.sync_states.split(",") if s)
    setup = Setup(**fields, sync_states=states)
    if setup.warmup_steps % setup.sync_every and "lordo-warmup" in arms:
        p.error(f"--warmup-steps {setup.warmup_steps} must be a multiple of --sync-every {setup.sync_every}")
    if min(setup.d_model, setup.layers, setup.batch, setup.context, setup.steps, setup.sync_every, setup.rank) < 1 \
            or setup.d_model % setup.heads:
        p.error("--d-model (a multiple of --heads), --layers, --batch, --context, --steps, --sync-every and "
                "--rank must be >= 1")
    rows = run_sweep(arms, lrs, tuple(range(seeds)), setup, json_path=args.json)
    import commwire as cw

    comm = cw.init()
    if comm.rank == 0:
        _publish(format_report(summarize(rows), setup, comm.size, tuple(range(seeds))), args.out)


if __name__ == "__main__":
    main()
