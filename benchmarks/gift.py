"""Evaluate GIFT against the honest baselines on a transformer whose activations carry outlier features.

Model: the byte-level TinyGPT of :mod:`commwire.bench.lm` (Python documentation
text) with injected outlier features (``_outliers.py`` beside this script: fixed
gains ×32 on 4 input channels of every MLP down-projection, ×8 on the
attention and MLP input projections). Data parallel over ``ranks`` simulated
ranks (``_simulated.py`` beside this script, bit-identical to commwire's
``compressed_allreduce``), each with its own micro-batch; the gradients travel
in DistributedOptimizer's fusion buckets (``layout="bucket"``: one payload
scale per pipeline chunk is shared by the tensors in it) or one all-reduce per
tensor (``layout="tensor"``). Every codec trains its own copy of the model with
Adam from the same seed (same weights, same batches); GIFT codecs profile the
range hits of direct encoding over the first ``profile`` steps, whiten the
fragile layers from then on and refresh every 50 steps (the paper's protocol).

Metrics, on the steps ``measure_from``, ``measure_from + measure_every``, ...
(all after GIFT's profile), pooled over all parameters (root of summed squares):

- range hits: % of the non-zero values encoded (every payload: each rank's
  chunks and the re-encoded sums) whose code is flushed to zero or is the
  format's top code (:func:`commwire.codecs.gift.range_hits`);
- Euclidean: ||ĝ − g|| / ||g||, ĝ the decoded all-reduce, g the exact FP32
  average of the same rank gradients;
- Adam-scaled: the same after dividing each coordinate by √v̂ + ε, where v̂ is
  Adam's bias-corrected second moment as the exact gradient would update it
  this step — the error in the units of the update;
- validation loss every ``eval_every`` steps (fixed held-out windows).

Each is reported as mean ± sample sd over the seeds; the paired difference of
validation loss to direct FP8 (same seed) too. Results are deterministic for a
given configuration (one torch thread, fixed segments, seeded data).

Run from a checkout of the repository: ``python benchmarks/gift.py`` (every run in
this process), ``commwire run -np 2 python benchmarks/gift.py`` (the runs shared by
2 worker processes), ``--quick`` (a tiny model in seconds, for tests). Writes
``gift_report.md`` and ``gift_results.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

# Beside this script: it runs as a file (python benchmarks/gift.py), which puts its folder on sys.path.
from _outliers import OutlierConfig, inject_outliers
from _simulated import SimulatedAllreduce

__all__ = ["GiftBenchConfig", "CODECS", "QUICK_CODECS", "train_run", "summarise", "format_table", "verdicts",
           "run_gift_bench", "build_parser", "main"]

CODECS = (
    "none",
    "fp8-e4m3", "ef+fp8-e4m3", "fp8-e4m3:block=128", "hadamard+fp8-e4m3", "gift:profile=100+fp8-e4m3",
    "fp8-e5m2", "ef+fp8-e5m2", "fp8-e5m2:block=128", "hadamard+fp8-e5m2", "gift:profile=100+fp8-e5m2",
    "nvfp4", "ef+nvfp4", "hadamard+nvfp4", "gift:profile=100+nvfp4", "gift:ef=0,profile=100+nvfp4",
)
"""Compressions compared (``gift`` carries error feedback on its whitened layers; ``gift:ef=0``: the bare transform)."""
QUICK_CODECS = ("none", "fp8-e4m3", "nvfp4", "gift:profile=4,refresh=4,rank=8+nvfp4")
"""The --quick subset."""
DIRECT_FP8 = "fp8-e4m3"
"""The reference of the target: GIFT + NVFP4 should reach its validation loss."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GiftBenchConfig:
    """What the GIFT evaluation runs."""

    d_model: int = 128
    """LM width."""
    layers: int = 2
    """LM blocks."""
    context: int = 64
    """Tokens per sequence."""
    batch: int = 8
    """Sequences per simulated rank per step."""
    ranks: int = 2
    """Simulated data-parallel ranks."""
    lr: float = 1e-3
    """Adam learning rate."""
    steps: int = 400
    """Training steps per run."""
    eval_every: int = 100
    """Steps between validation losses."""
    val_batches: int = 16
    """Validation batches of 32 windows."""
    measure_from: int = 110
    """First measured step (after GIFT's 100 profile steps and its first refresh)."""
    measure_every: int = 10
    """Steps between measurements."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Model, data and outlier-channel seeds; every codec runs every seed."""
    outlier_channels: int = 4
    """Outlier channels per layer input (0: the plain model)."""
    outlier_gains: tuple[tuple[str, float], ...] = (("down", 32.0), ("qkv", 8.0), ("up", 8.0))
    """(layer suffix, gain) of the injected outlier features."""
    layout: str = "bucket"
    """``"bucket"``: DistributedOptimizer's fusion buckets; ``"tensor"``: one all-reduce per tensor."""
    codecs: tuple[str, ...] = CODECS
    """Compressions (``none`` = FP32 reference)."""

    def __post_init__(self) -> None:
        for name in ("d_model", "layers", "context", "batch", "ranks", "steps", "eval_every", "val_batches",
                     "measure_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GiftBenchConfig.{name}={value!r}; use an int >= 1")
        if not isinstance(self.measure_from, int) or not 1 <= self.measure_from <= self.steps:
            raise ValueError(f"GiftBenchConfig.measure_from={self.measure_from!r}; use a step in 1..steps={self.steps}")
        if not self.lr > 0:
            raise ValueError(f"GiftBenchConfig.lr={self.lr!r}; use a positive float")
        if self.layout not in ("bucket", "tensor"):
            raise ValueError(f"GiftBenchConfig.layout={self.layout!r}; use 'bucket' or 'tensor'")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"GiftBenchConfig.seeds={self.seeds!r}; give distinct seeds")
        if not self.codecs:
            raise ValueError("GiftBenchConfig.codecs is empty")

    @classmethod
    def quick(cls, **changes: Any) -> GiftBenchConfig:
        """Return a configuration that runs in seconds (for tests)."""
        base = dict(d_model=32, layers=1, context=16, batch=2, ranks=2, steps=12, eval_every=6, val_batches=2,
                    measure_from=6, measure_every=2, seeds=(0, 1), codecs=QUICK_CODECS)
        return cls(**{**base, **changes})


# ---------------------------------------------------------------------- one training run
def _model(cfg: GiftBenchConfig, seed: int) -> Any:
    from commwire.bench.lm import LMConfig, make_lm

    model = make_lm(LMConfig(d_model=cfg.d_model, layers=cfg.layers, context=cfg.context), seed)
    inject_outliers(model, OutlierConfig(channels=cfg.outlier_channels, gains=cfg.outlier_gains, seed=seed))
    return model


def _buckets(named: list[tuple[str, Any]], layout: str) -> list[Any]:
    """Return the fusion buckets DistributedOptimizer would build (fusion_threshold_mb=0 for ``tensor``)."""
    import commwire as cw
    from commwire.fusion import FusionBuffer

    threshold = 0 if layout == "tensor" else 25 << 20
    return FusionBuffer(named, comm=cw.init(), threshold_bytes=threshold, overlap=False).buckets


class _Sums:
    """Summed squares of errors and references, for pooled relative errors."""

    def __init__(self) -> None:
        self.v = {k: 0.0 for k in ("err", "ref", "adam_err", "adam_ref")}

    def add(self, err: np.ndarray, ref: np.ndarray, denom: np.ndarray) -> None:
        self.v["err"] += float(np.dot(err, err))
        self.v["ref"] += float(np.dot(ref, ref))
        e, r = err / denom, ref / denom
        self.v["adam_err"] += float(np.dot(e, e))
        self.v["adam_ref"] += float(np.dot(r, r))

    def result(self) -> dict[str, float]:
        v = self.v
        return {"euclid": float(np.sqrt(v["err"] / v["ref"])) if v["ref"] else 0.0,
                "adam": float(np.sqrt(v["adam_err"] / v["adam_ref"])) if v["adam_ref"] else 0.0}


def train_run(cfg: GiftBenchConfig, spec: str, seed: int) -> dict[str, Any]:
    """Train one model copy with compression ``spec``; return its curve, metrics and GIFT diagnostics."""
    import torch

    from commwire import codecs
    from commwire.torch.gift import GiftHooks, find_gift

    from commwire.bench.lm import Corpus, evaluate

    torch.manual_seed(seed)
    model, corpus = _model(cfg, seed), Corpus.load()
    named = list(model.named_parameters())
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    beta2, eps = opt.defaults["betas"][1], opt.defaults["eps"]
    codec = codecs.get(spec) if spec != "none" else None
    gift = find_gift(codec)
    hooks = GiftHooks(model, codec, named) if gift is not None else None
    params = dict(named)
    buckets = _buckets(named, cfg.layout)
    reduce = SimulatedAllreduce(codec, cfg.ranks) if codec is not None else None
    if reduce is not None:
        for b in buckets:
            reduce.bind_layout(b.id, list(zip(b.names, b.offsets, b.shapes)))
    gens = [torch.Generator().manual_seed(1000 * seed + r) for r in range(cfg.ranks)]
    by_id = {id(p): n for n, p in named}
    linear = {by_id[id(m.weight)] for m in model.modules() if isinstance(m, torch.nn.Linear)}
    sums, layer_sums = _Sums(), {}
    ratios: dict[str, list[float]] = {}
    curve, wire_bytes, values = [], 0, 0
    start = time.perf_counter()

    def val(step: int) -> None:
        curve.append((step, evaluate(model, corpus, batches=cfg.val_batches, seed=1234)))

    val(0)
    for step in range(1, cfg.steps + 1):
        measured = step >= cfg.measure_from and (step - cfg.measure_from) % cfg.measure_every == 0
        local = []
        for g in gens:
            x, y = corpus.batch("train", batch=cfg.batch, context=cfg.context, generator=g)
            model.zero_grad(set_to_none=False)
            model.loss(x, y).backward()
            local.append({n: p.grad.detach().reshape(-1).numpy().copy() for n, p in named})
        if reduce is not None:
            reduce.counting = measured
        for b in buckets:
            parts = [np.concatenate([grads[n] for n in b.names]) for grads in local]
            exact = np.mean(np.stack(parts).astype(np.float64), axis=0)
            out = reduce(b.id, parts) if reduce is not None else exact.astype(np.float32)
            if reduce is not None:
                wire_bytes += codec.wire_nbytes(out.size)
                values += out.size
            for name, off, numel in zip(b.names, b.offsets, b.numels):
                params[name].grad.copy_(torch.from_numpy(out[off:off + numel]).view_as(params[name]))
            if measured:
                denom = np.concatenate([_adam_denominator(opt, params[n], exact[o:o + k], beta2, eps)
                                        for n, o, k in zip(b.names, b.offsets, b.numels)])
                sums.add(out - exact, exact, denom)
                for name, off, numel in zip(b.names, b.offsets, b.numels):
                    if name in linear:
                        s = layer_sums.setdefault(name, _Sums())
                        part = slice(off, off + numel)
                        s.add(out[part] - exact[part], exact[part], denom[part])
        if measured and gift is not None:  # how well the normalisation keeps the whitened gradient's size
            for name, f in gift.factors().items():
                w = local[0][name].reshape(-1, f.d).astype(np.float64)
                ratios.setdefault(name, []).append(float(np.linalg.norm(f.forward(w)) / np.linalg.norm(w)))
        opt.step()
        if hooks is not None:
            hooks.after_step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            val(step)
    run = {"spec": spec, "seed": seed, "curve": curve, "final_val": curve[-1][1],
           "seconds": time.perf_counter() - start, **sums.result(),
           "bytes_per_value": wire_bytes / values if values else 4.0,
           "layers": {n: s.result() for n, s in sorted(layer_sums.items())}}
    run["hits"] = dict(reduce.hits) if reduce is not None else {"flushed": 0, "top": 0, "total": 0}
    if gift is not None:
        run["gift"] = {"selection": list(gift.selection or ()), "fragility": gift.fragility(),
                       "refreshes": int(gift.timings["refreshes"]),
                       "norm_ratio": {n: float(np.mean(v)) for n, v in ratios.items()},
                       "scale": {n: f.scale for n, f in gift.factors().items()}}
    return run


def _adam_denominator(opt: Any, p: Any, g: np.ndarray, beta2: float, eps: float) -> np.ndarray:
    """Return √v̂ + ε per coordinate: Adam's second moment updated with the exact gradient ``g``, bias-corrected."""
    state = opt.state.get(p, {})
    t = int(state["step"]) + 1 if "step" in state else 1
    v = state["exp_avg_sq"].reshape(-1).double().numpy() if "exp_avg_sq" in state else np.zeros_like(g)
    v = beta2 * v + (1 - beta2) * g * g
    return np.sqrt(v / (1 - beta2**t)) + eps


# ---------------------------------------------------------------------- summary and report
def _stats(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def summarise(runs: list[dict[str, Any]], cfg: GiftBenchConfig) -> list[dict[str, Any]]:
    """Return one row per codec: each metric's mean and sd over the seeds, the paired gap to direct FP8."""
    by_spec: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        by_spec.setdefault(r["spec"], {})[r["seed"]] = r
    rows = []
    for spec in cfg.codecs:
        seeds = by_spec.get(spec, {})
        if not seeds:
            continue
        rs = [seeds[s] for s in sorted(seeds)]
        row: dict[str, Any] = {"spec": spec, "seeds": sorted(seeds), "bytes_per_value": rs[0]["bytes_per_value"]}
        for key in ("final_val", "euclid", "adam"):
            row[key] = _stats([r[key] for r in rs])
        for kind in ("flushed", "top"):
            row[f"{kind}_pct"] = _stats([100.0 * r["hits"][kind] / max(r["hits"]["total"], 1) for r in rs])
        row["hits_pct"] = _stats([100.0 * (r["hits"]["flushed"] + r["hits"]["top"]) / max(r["hits"]["total"], 1)
                                  for r in rs])
        ref = by_spec.get(DIRECT_FP8, {})
        paired = [seeds[s]["final_val"] - ref[s]["final_val"] for s in sorted(seeds) if s in ref]
        row["vs_fp8"] = _stats(paired) if paired else None
        if "gift" in rs[0]:
            row["selection"] = [r["gift"]["selection"] for r in rs]
            ratios = [v for r in rs for v in r["gift"]["norm_ratio"].values()]
            row["norm_ratio"] = (float(min(ratios)), float(max(ratios))) if ratios else None
        rows.append(row)
    return rows


def _pm(stat: tuple[float, float] | None, fmt: str = ".4f") -> str:
    return "-" if stat is None else f"{stat[0]:{fmt}} ± {stat[1]:{fmt}}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render the summary as a Markdown table (mean ± sd over seeds)."""
    lines = ["| codec | B/value | range hits % (flushed + top) | Euclidean error | Adam-scaled error | "
             "val loss | Δ val vs fp8-e4m3 (paired) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        hits = f"{_pm(r['hits_pct'], '.3f')} ({r['flushed_pct'][0]:.3f} + {r['top_pct'][0]:.3f})"
        lines.append(f"| {r['spec']} | {r['bytes_per_value']:.3f} | {hits} | {_pm(r['euclid'])} | {_pm(r['adam'])} | "
                     f"{_pm(r['final_val'])} | {_pm(r['vs_fp8'], '+.4f')} |")
    return "\n".join(lines)


def _family(spec: str) -> str:
    return "E4M3" if "e4m3" in spec else "E5M2" if "e5m2" in spec else "NVFP4" if "nvfp4" in spec else "FP32"


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Say which codec wins each metric within each format, and whether the target holds (computed)."""
    out = []
    for family in ("E4M3", "E5M2", "NVFP4"):
        members = [r for r in rows if _family(r["spec"]) == family]
        if not members:
            continue
        for key, label in (("hits_pct", "range hits"), ("euclid", "Euclidean error"), ("adam", "Adam-scaled error"),
                           ("final_val", "validation loss")):
            best = min(members, key=lambda r: r[key][0])
            tied = [r["spec"] for r in members
                    if r is not best and r[key][0] - r[key][1] <= best[key][0] + best[key][1]]
            out.append(f"{family}, {label}: best {best['spec']} ({_pm(best[key])})"
                       + (f"; within one sd: {', '.join(tied)}" if tied else ""))
    spec = {r["spec"]: r for r in rows}
    ref = spec.get(DIRECT_FP8)
    for r in rows:
        if r["spec"].startswith("gift") and _family(r["spec"]) == "NVFP4" and ref is not None and r["vs_fp8"]:
            gap, spread = r["final_val"][0] - ref["final_val"][0], ref["final_val"][1]
            reached = "reaches" if gap <= spread else "does not reach"
            out.append(f"Target: {r['spec']} {reached} direct FP8's validation loss within the seed spread "
                       f"(mean gap {gap:+.4f}, sd of direct FP8 over seeds {spread:.4f}; paired gap "
                       f"{_pm(r['vs_fp8'], '+.4f')}) at {r['bytes_per_value']:.3f} vs "
                       f"{ref['bytes_per_value']:.3f} bytes per value")
    return out


def _markdown(result: dict[str, Any], argv: list[str]) -> str:
    cfg, rows = result["config"], result["rows"]
    parts = ["# GIFT evaluation", "",
             f"Command: `python benchmarks/gift.py {' '.join(argv)}` ({result['workers']} worker process(es), "
             f"{result['seconds']:.0f} s). Config: `{cfg}`.", "",
             "Model: TinyGPT with injected outlier features (benchmarks/_outliers.py), trained with Adam on "
             f"{cfg['ranks']} simulated data-parallel ranks; gradients in "
             f"{'fusion buckets (shared scales)' if cfg['layout'] == 'bucket' else 'one all-reduce per tensor'}. "
             "Errors are of the all-reduced gradient against the exact FP32 average, pooled over all parameters "
             f"on steps {cfg['measure_from']}, {cfg['measure_from'] + cfg['measure_every']}, ... ; the Adam-scaled "
             "error divides each coordinate by Adam's √v̂ + ε first. mean ± sample sd over seeds "
             f"{list(cfg['seeds'])}; validation loss after {cfg['steps']} steps (nats/byte).", "",
             format_table(rows), "", "## Verdicts (computed from the table)", ""]
    parts += [f"- {v}" for v in verdicts(rows)]
    gifts = [r for r in rows if "selection" in r]
    if gifts:
        parts += ["", "## GIFT's selected layers (per seed) and ||c W S⁻¹|| / ||W|| over the measured steps", ""]
        for r in gifts:
            ratio = "-" if not r["norm_ratio"] else f"{r['norm_ratio'][0]:.2f}..{r['norm_ratio'][1]:.2f}"
            parts.append(f"- {r['spec']}: {r['selection']}; norm ratio {ratio}")
    parts += ["", "## Validation loss curves (seed mean)", "", "| codec | " +
              " | ".join(f"step {s}" for s, _ in result["runs"][0]["curve"]) + " |",
              "|---" * (len(result["runs"][0]["curve"]) + 1) + "|"]
    for r in rows:
        curves = [run["curve"] for run in result["runs"] if run["spec"] == r["spec"]]
        means = np.mean([[v for _, v in c] for c in curves], axis=0)
        parts.append(f"| {r['spec']} | " + " | ".join(f"{m:.4f}" for m in means) + " |")
    return "\n".join(parts) + "\n"


def run_gift_bench(cfg: GiftBenchConfig, *, out: str | os.PathLike | None = "reports/gift",
                   argv: list[str] | None = None) -> dict[str, Any]:
    """Run every (codec, seed) on the current MPI world's workers; rank 0 writes Markdown and JSON into ``out``."""
    import torch

    import commwire as cw
    from commwire import codecs

    # Several workers share few cores: one thread each (numba's parallel kernels on an
    # oversubscribed machine wait for cores far longer than they compute).
    torch.set_num_threads(1)
    codecs.set_threads(1)
    comm = cw.init()
    jobs = [(spec, seed) for seed in cfg.seeds for spec in cfg.codecs]
    start = time.perf_counter()
    mine = [train_run(cfg, spec, seed) for i, (spec, seed) in enumerate(jobs) if i % comm.size == comm.rank]
    runs = [r for part in (comm.allgather_object(mine) if comm.size > 1 else [mine]) for r in part]
    runs.sort(key=lambda r: (cfg.codecs.index(r["spec"]), r["seed"]))
    result = {"config": dataclasses.asdict(cfg), "workers": comm.size, "seconds": time.perf_counter() - start,
              "runs": runs, "rows": summarise(runs, cfg)}
    if comm.rank == 0 and out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "gift_report.md").write_text(_markdown(result, argv or []), encoding="utf-8")
        (path / "gift_results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    return result


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``python benchmarks/gift.py``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/gift.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model and 4 codecs, in seconds (for tests)")
    d = GiftBenchConfig()
    for name in ("d_model", "layers", "context", "batch", "ranks", "steps", "eval_every", "val_batches",
                 "measure_from", "measure_every", "outlier_channels"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {getattr(d, name)}")
    parser.add_argument("--lr", type=float, default=None, help=f"default {d.lr}")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help=f"default {' '.join(map(str, d.seeds))}")
    parser.add_argument("--layout", choices=("bucket", "tensor"), default=None, help="default bucket")
    parser.add_argument("--codecs", nargs="+", default=None, help="codec specs ('none' = FP32); default: all")
    parser.add_argument("--out", default="reports/gift", help="output folder (Markdown, JSON)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the evaluation and print rank 0's table."""
    a = build_parser().parse_args(argv)
    changes = {k: v for k, v in vars(a).items() if k not in ("quick", "out") and v is not None}
    for key in ("seeds", "codecs"):
        if key in changes:
            changes[key] = tuple(changes[key])
    cfg = GiftBenchConfig.quick(**changes) if a.quick else GiftBenchConfig(**changes)
    result = run_gift_bench(cfg, out=a.out, argv=list(argv) if argv is not None else [])
    import commwire as cw

    if cw.rank() == 0:
        print(format_table(result["rows"]))
        print("\n".join(f"- {v}" for v in verdicts(result["rows"])))
        print(f"report: {Path(a.out) / 'gift_report.md'} ({result['seconds']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
