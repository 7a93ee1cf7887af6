"""Evaluate GIFT against direct FP8, per-block FP8, error feedback and Hadamard on real LM gradients.

Part 1, round-trip errors: a small transformer LM (:mod:`commwire.bench.lm`) is
trained in FP32 for ``warmup`` steps on the Python documentation text; the
inputs of its ``nn.Linear`` layers over the next ``stat_steps`` steps give the
GIFT factors (as a refresh would), and the gradients of the ``error_steps``
steps after that are sent through every codec variant, once per tensor (its own
scale) and once as one fused bucket of all parameters (one shared scale for the
per-tensor formats). Errors of each weight gradient W, with E = decoded − W:
Euclidean ||E||/||W||, A-norm ||E L||/||W L|| and A⁻¹-norm ||L⁻¹Eᵀ||/||L⁻¹Wᵀ||,
where L Lᵀ = A (damped) is measured on the error steps' own inputs. Reported
per layer and pooled (root of summed squares), mean over the steps; error
feedback variants also get the error of the summed gradients over the steps.

Part 2, training: every compression in ``train_codecs`` trains its own copy of
the same model (same seed and data) on all ranks, the copies taking turns in
rounds of ``eval_every`` steps so that machine noise hits them alike; reported:
validation-loss curves, final validation loss and its gap to FP32, gradient
bytes per step, median step time, and GIFT's own time (transform, error
feedback, statistics, refresh) per step.

Run: ``commwire bench gift -np 4`` (writes PNG + Markdown into ``--out``).
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

__all__ = ["GiftBenchConfig", "ERROR_VARIANTS", "TRAIN_CODECS", "run_gift_bench", "format_table", "main"]

ERROR_VARIANTS = (
    "fp8-e4m3", "fp8-e5m2", "fp8-e4m3:block=128", "fp8-e5m2:block=128", "ef+fp8-e4m3", "hadamard+fp8-e4m3",
    "gift:ef=0+fp8-e4m3", "gift:ef=0,rank=0+fp8-e4m3", "gift+fp8-e4m3", "gift:ef=0+fp8-e5m2",
    "gift:ef=0,primal=1+fp8-e4m3",
    "nvfp4", "ef+nvfp4", "hadamard+nvfp4", "gift:ef=0+nvfp4", "gift+nvfp4", "gift:ef=0,primal=1+nvfp4",
)
"""Codec specs of part 1 (``gift:ef=0`` is the bare transform; ``gift`` adds its error feedback;
``primal=1`` sends W S, the orientation whose error is isotropic in the A-norm, instead of the paper's W S⁻¹)."""
TRAIN_CODECS = ("none", "fp8-e4m3", "ef+fp8-e4m3", "gift+fp8-e4m3", "nvfp4", "gift+nvfp4")
"""Compressions of part 2 (``ef+fp8-e4m3`` separates GIFT's error feedback from its transform)."""


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
    """Sequences per rank per step."""
    lr: float = 1e-3
    """Adam learning rate."""
    seed: int = 0
    """Model and data seed (the same for every compression)."""
    warmup: int = 60
    """Part 1: FP32 steps before gradients are measured."""
    stat_steps: int = 10
    """Part 1: steps whose layer inputs build the GIFT factors."""
    error_steps: int = 6
    """Part 1: consecutive steps whose gradients are encoded."""
    steps: int = 120
    """Part 2: training steps per compression (0 skips part 2)."""
    eval_every: int = 20
    """Part 2: steps between validation losses (also the round length)."""
    error_codecs: tuple[str, ...] = ERROR_VARIANTS
    """Part 1 codec specs."""
    train_codecs: tuple[str, ...] = TRAIN_CODECS
    """Part 2 compressions."""

    def __post_init__(self) -> None:
        for name in ("d_model", "layers", "context", "batch", "warmup", "stat_steps", "error_steps", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"GiftBenchConfig.{name}={getattr(self, name)!r}; use an int >= 1")
        if self.steps < 0:
            raise ValueError(f"GiftBenchConfig.steps={self.steps!r}; use an int >= 0")
        if not self.lr > 0:
            raise ValueError(f"GiftBenchConfig.lr={self.lr!r}; use a positive float")


def _lm(cfg: GiftBenchConfig) -> tuple[Any, Any]:
    from .lm import Corpus, LMConfig, make_lm

    return make_lm(LMConfig(d_model=cfg.d_model, layers=cfg.layers, context=cfg.context), cfg.seed), Corpus.load()


def _linear_weights(model: Any) -> dict[str, Any]:
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(m.weight)]: m for m in model.modules() if isinstance(m, torch.nn.Linear)}


def _collect_gradients(cfg: GiftBenchConfig, ranks: int) -> dict[str, Any]:
    """Train in FP32; return the factor statistics, the metric statistics and per-step gradients."""
    import torch

    model, corpus = _lm(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    linears = _linear_weights(model)
    grams: dict[str, list] = {n: [np.zeros((m.in_features,) * 2), 0] for n, m in linears.items()}
    recording = [False]

    def hook(name: str) -> Any:
        def fn(module: Any, inputs: Any, output: Any) -> None:
            if recording[0]:
                a = inputs[0].detach().reshape(-1, module.in_features).double()
                grams[name][0] += (a.T @ a).numpy()
                grams[name][1] += a.shape[0]
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    stats, grads = {}, []
    for step in range(cfg.warmup + cfg.stat_steps + cfg.error_steps):
        if step == cfg.warmup + cfg.stat_steps:  # the factor window ends, the metric window starts
            stats = {n: (g.copy(), c) for n, (g, c) in grams.items()}
            for g in grams.values():
                g[0][...], g[1] = 0.0, 0
        recording[0] = step >= cfg.warmup
        x, y = corpus.batch("train", batch=cfg.batch * ranks, context=cfg.context, generator=gen)
        opt.zero_grad()
        model.loss(x, y).backward()
        if step >= cfg.warmup + cfg.stat_steps:
            grads.append({n: p.grad.detach().numpy().astype(np.float32).copy() for n, p in model.named_parameters()})
        opt.step()
    for h in handles:
        h.remove()
    return {"stats": stats, "metric": {n: g / c for n, (g, c) in grams.items()}, "grads": grads,
            "order": [n for n, _ in model.named_parameters()], "linears": sorted(linears)}


def _metric_factors(metric: dict[str, np.ndarray], damping: float) -> dict[str, np.ndarray]:
    out = {}
    for name, a in metric.items():
        d = a.shape[0]
        out[name] = np.linalg.cholesky(a + damping * np.trace(a) / d * np.eye(d))
    return out


def _round_trip(spec: str, data: dict[str, Any], fused: bool) -> list[dict[str, np.ndarray]]:
    """Encode every step's gradients with a fresh codec; return the decoded gradients per step."""
    from commwire import codecs

    codec = codecs.get(spec)
    gift = next((s for s in codec.stages if type(s).__name__ == "Gift"), None)
    if gift is not None:
        for name, (g, c) in data["stats"].items():
            gift.observe(name, g, c)
        gift.refresh()
    order = list(reversed(data["order"]))  # FusionBuffer fills buckets in reverse registration order
    shapes = {n: data["grads"][0][n].shape for n in order}
    offsets = np.concatenate(([0], np.cumsum([int(np.prod(shapes[n])) for n in order]))).tolist()
    if fused:
        codec.bind_layout("bucket", [(n, offsets[i], shapes[n]) for i, n in enumerate(order)])
    out = []
    for grads in data["grads"]:
        if fused:
            flat = np.concatenate([grads[n].ravel() for n in order])
            dec = _codec_trip(codec, flat, "bucket")
            out.append({n: dec[offsets[i]:offsets[i + 1]].reshape(shapes[n]) for i, n in enumerate(order)})
        else:
            out.append({n: _codec_trip(codec, grads[n].ravel(), n).reshape(shapes[n]) for n in order})
    return out


def _codec_trip(codec: Any, flat: np.ndarray, key: str) -> np.ndarray:
    y = codec.tensor_forward(flat, key)
    dec = codec.decode(codec.encode(y, key=key))
    codec.tensor_inverse(dec, key)
    return dec


def _errors(data: dict[str, Any], decoded: list[dict[str, np.ndarray]], chol: dict[str, np.ndarray]
            ) -> dict[str, dict[str, float]]:
    """Return {layer or 'all weights' / 'all params': {metric: relative error}} (mean over steps)."""
    def norms(m: np.ndarray, name: str) -> tuple[float, float, float]:
        m = m.astype(np.float64)
        if name not in chol:
            e = float(np.sum(m * m))
            return e, e, e
        low = chol[name]
        return float(np.sum(m * m)), float(np.sum((m @ low) ** 2)), float(np.sum(np.linalg.solve(low, m.T) ** 2))

    keys = ("euclid", "a_norm", "a_inv_norm")
    per_step: dict[str, dict[str, list[float]]] = {}
    cum_err: dict[str, np.ndarray] = {}
    cum_ref: dict[str, np.ndarray] = {}
    for grads, dec in zip(data["grads"], decoded):
        pooled = {"all weights": np.zeros(6), "all params": np.zeros(6)}
        for name in data["order"]:
            err, ref = norms(dec[name] - grads[name], name), norms(grads[name], name)
            cum_err[name] = cum_err.get(name, 0.0) + (dec[name] - grads[name])
            cum_ref[name] = cum_ref.get(name, 0.0) + grads[name]
            row = per_step.setdefault(name, {k: [] for k in keys})
            for i, k in enumerate(keys):
                row[k].append(np.sqrt(err[i] / ref[i]) if ref[i] > 0 else 0.0)
            pooled["all params"] += np.array(err + ref)
            if name in chol:
                pooled["all weights"] += np.array(err + ref)
        for label, v in pooled.items():
            row = per_step.setdefault(label, {k: [] for k in keys})
            for i, k in enumerate(keys):
                row[k].append(np.sqrt(v[i] / v[i + 3]))
    result = {name: {k: float(np.mean(v)) for k, v in row.items()} for name, row in per_step.items()}
    acc = np.zeros(6)
    for name in data["linears"]:
        acc += np.array(norms(cum_err[name], name) + norms(cum_ref[name], name))
    result["all weights"].update({f"sum_{k}": float(np.sqrt(acc[i] / acc[i + 3])) for i, k in enumerate(keys)})
    return result


def run_error_part(cfg: GiftBenchConfig, comm: Any = None) -> dict[str, Any]:
    """Part 1: round-trip errors of every variant, per tensor and fused; variants split over ranks."""
    from commwire.codecs.gift import GiftConfig

    size, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
    data = _collect_gradients(cfg, size)
    chol = _metric_factors(data["metric"], GiftConfig().damping)
    mine = {}
    for i, spec in enumerate(cfg.error_codecs):
        if i % size == rank:
            for fused in (False, True):
                mine[(spec, "bucket" if fused else "tensor")] = _errors(data, _round_trip(spec, data, fused), chol)
    rows: dict[tuple[str, str], Any] = {}
    for part in (comm.allgather_object(mine) if comm is not None and size > 1 else [mine]):
        rows.update(part)
    ordered = sorted(rows, key=lambda k: (cfg.error_codecs.index(k[0]), k[1]))  # ranks return them interleaved
    return {"rows": {f"{spec}|{where}": rows[(spec, where)] for spec, where in ordered}, "linears": data["linears"]}


def run_train_part(cfg: GiftBenchConfig, comm: Any) -> dict[str, Any]:
    """Part 2: train one model copy per compression on all ranks, in interleaved rounds."""
    import torch

    import commwire as cw
    import commwire.torch as hvd
    from commwire import codecs
    from commwire.torch.gift import find_gift

    from .lm import evaluate

    runs = []
    for spec in cfg.train_codecs:
        model, corpus = _lm(cfg)
        codec = codecs.get(spec) if spec != "none" else None
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=cfg.lr),
                                       named_parameters=model.named_parameters(), compression=codec or "none",
                                       model=model if find_gift(codec) is not None else None, comm=comm)
        runs.append({"spec": spec, "model": model, "opt": opt, "codec": codec,
                     "gen": torch.Generator().manual_seed(1000 * cfg.seed + comm.rank), "times": [],
                     "curve": [], "grad_bytes": 0, "other_bytes": 0})

    def val(run: dict[str, Any], step: int) -> None:
        # every rank scores 2 of 8 fixed batches; the average is the same on all ranks
        local = evaluate(run["model"], corpus, batches=max(1, 8 // comm.size), seed=1234 + comm.rank)
        run["curve"].append((step, float(comm.allreduce(np.array([local]), "avg")[0])))

    for run in runs:
        val(run, 0)
    done = 0
    while done < cfg.steps:
        chunk = min(cfg.eval_every, cfg.steps - done)
        for run in runs:
            comm.barrier()
            cw.stats(reset=True)
            model, opt = run["model"], run["opt"]
            for _ in range(chunk):
                x, y = corpus.batch("train", batch=cfg.batch, context=cfg.context, generator=run["gen"])
                start = time.perf_counter()
                opt.zero_grad()
                model.loss(x, y).backward()
                opt.step()
                run["times"].append(time.perf_counter() - start)
            snap = cw.stats(reset=True)
            run["grad_bytes"] += snap.get("compressed_allreduce", {}).get("bytes", 0)
            run["grad_bytes"] += snap.get("allreduce", {}).get("bytes", 0) if run["codec"] is None else 0
            run["other_bytes"] += snap.get("allreduce", {}).get("bytes", 0) if run["codec"] is not None else 0
            val(run, done + chunk)
        done += chunk
        if comm.rank == 0:
            print(f"step {done}/{cfg.steps}: " + ", ".join(f"{r['spec']} {r['curve'][-1][1]:.3f}" for r in runs),
                  flush=True)
    rows = []
    for run in runs:
        medians = comm.allgather_object(float(np.median(run["times"])) if run["times"] else 0.0)
        gift = find_gift(run["codec"])
        row = {"spec": run["spec"], "curve": run["curve"], "final_val": run["curve"][-1][1],
               "step_ms": max(medians) * 1e3, "grad_bytes_per_step": run["grad_bytes"] / max(cfg.steps, 1),
               "refresh_bytes_per_step": 0.0, "gift_ms": {}}
        if gift is not None:
            hooks = run["opt"]._gift
            # factors travel by allgather_object (not in the byte counters): d_in*r + r + 1 float64 per layer
            factor_bytes = sum((f.u.size + f.lam.size + 1) * 8 for f in gift.factors().values()) * gift.timings["refreshes"]
            row["refresh_bytes_per_step"] = (run["other_bytes"] + factor_bytes) / max(cfg.steps, 1)
            per_step = {k: v for k, v in gift.timings.items() if k.endswith("_s")}
            per_step["stats_s"] = hooks.timings["stats_s"]
            everyone = comm.allgather_object(per_step)
            row["gift_ms"] = {k[:-2]: max(e[k] for e in everyone) / max(cfg.steps, 1) * 1e3 for k in per_step}
            row["refreshes"] = gift.timings["refreshes"]
        rows.append(row)
    base = next((r["final_val"] for r in rows if r["spec"] == "none"), float("nan"))
    for r in rows:
        r["gap_to_fp32"] = r["final_val"] - base
    return {"rows": rows, "ranks": comm.size}


def format_table(result: dict[str, Any], where: str = "tensor", metric: str = "a_norm") -> str:
    """Render part 1 as a Markdown table: one row per codec, one column per layer and pooled."""
    rows = {k.split("|")[0]: v for k, v in result["rows"].items() if k.endswith("|" + where)}
    layers = result["linears"] + ["all weights"]
    short = [n.replace("blocks.", "b").replace(".weight", "") for n in layers]
    lines = ["| codec | " + " | ".join(short) + " |", "|---" * (len(layers) + 1) + "|"]
    for spec, errs in rows.items():
        best = ""
        lines.append(f"| {spec}{best} | " + " | ".join(f"{errs[n][metric]:.4f}" for n in layers) + " |")
    return "\n".join(lines)


def _format_train(train: dict[str, Any]) -> str:
    lines = ["| compression | final val loss | gap to FP32 | gradient MB/step | GIFT refresh kB/step | "
             "median step ms | GIFT ms/step (transform / EF / stats / refresh) |", "|---|---|---|---|---|---|---|"]
    for r in train["rows"]:
        g = r["gift_ms"]
        gift = (f"{g['transform']:.2f} / {g['feedback']:.2f} / {g['stats']:.2f} / {g['refresh']:.2f}" if g else "-")
        lines.append(f"| {r['spec']} | {r['final_val']:.4f} | {r['gap_to_fp32']:+.4f} | "
                     f"{r['grad_bytes_per_step'] / 1e6:.3f} | {r['refresh_bytes_per_step'] / 1e3:.1f} | "
                     f"{r['step_ms']:.1f} | {gift} |")
    return "\n".join(lines)


def _verdicts(errors: dict[str, Any]) -> list[str]:
    """Say plainly which variant wins where (computed from the numbers, nothing assumed)."""
    out = []
    rows = errors["rows"]
    for family, members in (("FP8", [s for s in {k.split("|")[0] for k in rows} if "fp8" in s]),
                            ("NVFP4", [s for s in {k.split("|")[0] for k in rows} if "nvfp4" in s])):
        for where in ("tensor", "bucket"):
            for metric in ("euclid", "a_norm", "a_inv_norm"):
                ranked = sorted(members, key=lambda s: rows[f"{s}|{where}"]["all weights"][metric])
                if not ranked:
                    continue
                best = ranked[0]
                direct = "fp8-e4m3" if family == "FP8" else "nvfp4"
                inner = "fp8-e4m3" if family == "FP8" else "nvfp4"
                line = (f"{family}, {where}, {metric}: best {best} "
                        f"({rows[f'{best}|{where}']['all weights'][metric]:.4f})")
                for label, gift in (("GIFT", f"gift:ef=0+{inner}"), ("primal GIFT", f"gift:ef=0,primal=1+{inner}")):
                    if f"{gift}|{where}" in rows and f"{direct}|{where}" in rows:
                        factor = (rows[f"{direct}|{where}"]["all weights"][metric]
                                  / rows[f"{gift}|{where}"]["all weights"][metric])
                        line += f"; direct / {label} error = {factor:.2f}x"
                per_layer = {n: min(members, key=lambda s: rows[f"{s}|{where}"][n][metric]) for n in errors["linears"]}
                gift_wins = [n for n, s in per_layer.items() if s.startswith("gift")]
                line += f"; a GIFT variant is best on {len(gift_wins)}/{len(per_layer)} layers"
                out.append(line)
    return out


def _plots(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    errors = result["errors"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=False)
    for ax, where in zip(axes, ("tensor", "bucket")):
        specs = [k.split("|")[0] for k in errors["rows"] if k.endswith("|" + where)]
        layers = errors["linears"] + ["all weights"]
        width = 0.8 / max(len(specs), 1)
        colours = plt.get_cmap("tab20")
        for i, spec in enumerate(specs):
            vals = [errors["rows"][f"{spec}|{where}"][n]["a_norm"] for n in layers]
            ax.bar(np.arange(len(layers)) + i * width, vals, width, label=spec, color=colours(i % 20))
        ax.set_xticks(np.arange(len(layers)) + 0.4, [n.replace(".weight", "") for n in layers], rotation=60,
                      fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"A-norm relative error, {'per tensor' if where == 'tensor' else 'one fused bucket'}")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "gift_errors.png", dpi=120)
    plt.close(fig)
    files.append("gift_errors.png")
    specs = [k.split("|")[0] for k in errors["rows"] if k.endswith("|tensor")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.28 * len(specs) + 1.5), sharey=True)
    for ax, (metric, label) in zip(axes, (("euclid", "Euclidean"), ("a_norm", "A-norm"), ("a_inv_norm", "A⁻¹-norm"))):
        vals = [errors["rows"][f"{spec}|tensor"]["all weights"][metric] for spec in specs]
        ax.barh(np.arange(len(specs)), vals, color=["tab:red" if sp.startswith("gift") else "tab:blue" for sp in specs])
        ax.set_xscale("log")
        ax.set_title(f"{label} error, all weights (per tensor)", fontsize=9)
    axes[0].set_yticks(np.arange(len(specs)), specs, fontsize=7)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "gift_norms.png", dpi=120)
    plt.close(fig)
    files.append("gift_norms.png")
    if result.get("train"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in result["train"]["rows"]:
            steps, vals = zip(*r["curve"])
            ax.plot(steps, vals, marker="o", ms=3, label=r["spec"])
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_title(f"TinyGPT on {result['train']['ranks']} ranks")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "gift_training.png", dpi=120)
        plt.close(fig)
        files.append("gift_training.png")
    return files


def _markdown(result: dict[str, Any], cfg: GiftBenchConfig, files: list[str], argv: list[str]) -> str:
    errors = result["errors"]
    parts = ["# GIFT evaluation", "",
             f"Command: `commwire bench gift {' '.join(argv)}` ({result['ranks']} ranks). Config: "
             f"`{dataclasses.asdict(cfg)}`.", "",
             "Metrics (relative, mean over the error steps): Euclidean ||E||/||W||; A-norm ||E L||/||W L||; "
             "A⁻¹-norm ||L⁻¹Eᵀ||/||L⁻¹Wᵀ||, with L Lᵀ the damped input second moment of the layer measured on "
             "the error steps' own batches (the GIFT factors come from the preceding steps). 'all weights' pools "
             "the nn.Linear weights (root of summed squares). `gift:ef=0` is the bare transform; `gift` adds its "
             "error feedback; `gift:primal=1` sends W S instead of W S⁻¹.", "",
             "Which norm a transform favours follows from the algebra, not from these runs: a relative-precision "
             "format leaves an error roughly proportional to what it encodes, so sending W S⁻¹ (the paper's "
             "whitening) leaves an error that is small in the A⁻¹-norm, the dual norm that K-FAC assigns to "
             "gradients, while sending W S leaves one of about the format's relative error in the A-norm. Direct "
             "encoding can still win in the A-norm: gradients lie mostly along the large-A directions, which the "
             "A-norm weighs most and in which their own relative error is smallest. The tables say what happens "
             "on these gradients.", "", "## Verdicts (computed)", ""]
    parts += [f"- {v}" for v in _verdicts(errors)]
    for where, title in (("tensor", "per tensor (own scale)"), ("bucket", "one fused bucket of all parameters")):
        for metric, label in (("a_norm", "A-norm"), ("euclid", "Euclidean"), ("a_inv_norm", "A⁻¹-norm")):
            parts += ["", f"## {label} error, {title}", "", format_table(errors, where, metric)]
    parts += ["", "## Error of the summed gradients over the error steps (all weights; shows error feedback)", "",
              "| codec | where | Euclidean | A-norm | A⁻¹-norm |", "|---|---|---|---|---|"]
    for key, v in errors["rows"].items():
        spec, where = key.split("|")
        w = v["all weights"]
        parts.append(f"| {spec} | {where} | {w['sum_euclid']:.4f} | {w['sum_a_norm']:.4f} | {w['sum_a_inv_norm']:.4f} |")
    if result.get("train"):
        parts += ["", f"## Training ({result['train']['ranks']} ranks, {cfg.steps} steps, batch {cfg.batch}/rank)",
                  "", _format_train(result["train"])]
        rows = {r["spec"]: r for r in result["train"]["rows"]}
        for direct, gift in (("fp8-e4m3", "gift+fp8-e4m3"), ("nvfp4", "gift+nvfp4")):
            if direct in rows and gift in rows:
                d, g = rows[direct], rows[gift]
                parts.append(f"\n- {gift} vs {direct}: gap to FP32 {g['gap_to_fp32']:+.4f} vs "
                             f"{d['gap_to_fp32']:+.4f} ({'no worse' if g['gap_to_fp32'] <= d['gap_to_fp32'] else 'worse'}"
                             f"); step time {g['step_ms']:.1f} vs {d['step_ms']:.1f} ms "
                             f"(GIFT overhead {g['step_ms'] - d['step_ms']:+.1f} ms, "
                             f"{(g['step_ms'] / d['step_ms'] - 1) * 100:+.0f}%)")
    parts += ["", "Plots: " + ", ".join(f"![{f}]({f})" for f in files), ""]
    return "\n".join(parts)


def run_gift_bench(cfg: GiftBenchConfig | None = None, *, out: str | os.PathLike = "reports/gift",
                   argv: list[str] | None = None) -> dict[str, Any]:
    """Run both parts on the current MPI world; rank 0 writes PNG, Markdown and JSON into ``out``."""
    import torch

    import commwire as cw

    cfg = cfg or GiftBenchConfig()
    torch.set_num_threads(1)
    _single_blas_thread()
    comm = cw.init()
    result: dict[str, Any] = {"ranks": comm.size}
    t0 = time.perf_counter()
    result["errors"] = run_error_part(cfg, comm)
    result["error_seconds"] = time.perf_counter() - t0
    _write(result, cfg, Path(out), argv, comm.rank)  # part 1 survives if part 2 is interrupted
    if cfg.steps and comm.size > 1:
        t0 = time.perf_counter()
        result["train"] = run_train_part(cfg, comm)
        result["train_seconds"] = time.perf_counter() - t0
        _write(result, cfg, Path(out), argv, comm.rank)
    return result


def _write(result: dict[str, Any], cfg: GiftBenchConfig, path: Path, argv: list[str] | None, rank: int) -> None:
    if rank != 0:
        return
    path.mkdir(parents=True, exist_ok=True)
    files = _plots(result, path)
    (path / "gift_report.md").write_text(_markdown(result, cfg, files, argv or []), encoding="utf-8")
    (path / "gift_results.json").write_text(json.dumps(result, indent=1, default=float), encoding="utf-8")
    print(f"wrote {path / 'gift_report.md'}", flush=True)


def _single_blas_thread() -> None:
    # Several ranks share few cores: BLAS threads per rank would only fight each other.
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(1)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the evaluation and print rank 0's summary."""
    parser = argparse.ArgumentParser(prog="commwire bench gift", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    d = GiftBenchConfig()
    for name in ("d_model", "layers", "context", "batch", "warmup", "stat_steps", "error_steps", "steps",
                 "eval_every", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--error-codecs", nargs="+", default=list(d.error_codecs), help="codec specs (part 1)")
    parser.add_argument("--train-codecs", nargs="+", default=list(d.train_codecs), help="compressions (part 2)")
    parser.add_argument("--out", default="reports/gift", help="output folder (PNG, Markdown, JSON)")
    a = parser.parse_args(argv)
    cfg = GiftBenchConfig(**{k: getattr(a, k) for k in ("d_model", "layers", "context", "batch", "warmup",
                                                         "stat_steps", "error_steps", "steps", "eval_every", "seed",
                                                         "lr")},
                          error_codecs=tuple(a.error_codecs), train_codecs=tuple(a.train_codecs))
    result = run_gift_bench(cfg, out=a.out, argv=list(argv) if argv is not None else [])
    import commwire as cw

    if cw.rank() == 0:
        print(format_table(result["errors"], "tensor", "a_norm"))
        print(format_table(result["errors"], "bucket", "a_norm"))
        if result.get("train"):
            print(_format_train(result["train"]))
        print(f"report: {Path(a.out) / 'gift_report.md'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
