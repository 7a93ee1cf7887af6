"""Calibrate the α–β cost model (commwire.costmodel) on measured times, validate it, project to many nodes.

Inputs are JSON files of the package's benchmarks:

- ``commwire bench allreduce --json``: FP32 rows fit α, α_large and β (and, when
  the ranks shared fewer ``--cores`` than there were ranks, the core-sharing
  exponents κ_α, κ_β); sizes or node counts left out of the fit (``--fit-sizes``)
  are predicted and the error reported. Compressed rows (``--codec``) are checked
  at the segment their tuner chose, with the codecs' throughput measured here.
- ``commwire bench glm --json`` (each loop also timed alone on one rank's block, c):
  a training loop is a sequence of k exchanges, each compute then an all-reduce,

      T_loop = max(k·(c·μ·g^κ_c + L), (k·V − burst)·β)   on the lab,
      T_loop = k·(c + L + V·β)                           on a cluster,

  since the lab's token bucket refills while ranks compute, and a timed loop
  starts on an idle link with its bucket (``burst``) full. μ and κ_c are fitted
  on the loops of some node counts and solvers (``--glm-fit-nodes``,
  ``--glm-fit-solvers``) and the others predicted; ranks that compute while
  others spin in MPI on the same cores stretch c beyond g. The projection takes
  c per rank as a + b/P (a fixed part and the n/P columns), fitted on the
  measured node counts.

The fitted link, with one rank per node on real links, is then projected to
``--nodes`` as ``commwire bench project`` does (``--bandwidth`` and
``--latency`` replace the fitted values).

Run from a checkout of the repository:
    python benchmarks/calibrate.py --calibrate lab2.json lab4.json lab8.json --fit-sizes 16,4K,256K,16M \
        --validate lab2.json lab4.json lab8.json
    python benchmarks/calibrate.py --calibrate lab2.json lab4.json lab8.json \
        --glm glm2.json glm4.json glm8.json --glm-fit-nodes 2,4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from commwire.bench.allreduce import parse_size
from commwire.bench.project import parse_latency, projection
from commwire.costmodel import (INJECT_BYTES, LinkModel, allreduce_seconds, codec_rates, compressed_seconds, fit,
                                nonneg_lstsq, round_terms, rounds)
from commwire.lab.bandwidth import parse_bandwidth, tbf_burst

__all__ = ["load_samples", "load_codec_rows", "load_glm", "validate", "validate_codec", "glm_seconds", "loop_terms",
           "fit_compute", "validate_glm", "compute_at", "main"]


# ------------------------------------------------------------------ measurement files
def load_samples(paths: list[str]) -> list[tuple[int, float, float]]:
    """Return the FP32 all-reduce samples (nodes, bytes, seconds) of ``commwire bench allreduce --json`` files."""
    samples = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            rows = json.load(fh)
        samples += [(int(r["ranks"]), float(r["bytes"]), float(r["raw_us"]) * 1e-6) for r in rows
                    if not r.get("codec")]
    return samples


def load_codec_rows(paths: list[str]) -> list[dict[str, Any]]:
    """Return the compressed rows (``bench allreduce --codec ... --json``): nodes, bytes, codec, both times."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            out += [{"nodes": int(r["ranks"]), "bytes": float(r["bytes"]), "codec": r["codec"],
                     "fp32_s": float(r["raw_us"]) * 1e-6, "codec_s": float(r["commwire_us"]) * 1e-6,
                     "segment": r.get("segment_bytes")}
                    for r in json.load(fh) if r.get("codec")]
    return out


def load_glm(paths: list[str]) -> list[dict[str, Any]]:
    """Return the headline rows of ``commwire bench glm --json`` files that carry the compute-alone time."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            rows = [r for r in json.load(fh) if r.get("table") == "headline"]
        missing = [r for r in rows if "compute_s" not in r]
        if missing:
            raise ValueError(f"{path} has no compute_s column; rerun commwire bench glm --json with this "
                             "version, which times each loop alone as well")
        out += [{"nodes": int(r["ranks"]), "dataset": r["dataset"], "solver": r["solver"],
                 "precision": r["precision"], "s": int(r["s"]), "b": int(r["b"]), "steps": int(r["steps"]),
                 "bytes": float(r["bytes_per_outer"]), "exchanges": math.ceil(int(r["steps"]) / int(r["s"])),
                 "wall_s": float(r["wall_s"]), "compute_s": float(r["compute_s"])} for r in rows]
    return out


# ------------------------------------------------------------------ all-reduce checks
def validate(m: LinkModel, samples: list[tuple[int, float, float]],
             fitted: set[tuple[int, float]] | None = None) -> list[dict[str, Any]]:
    """Return measured vs predicted FP32 all-reduce time for each sample (``fit``: was it fitted on)."""
    out = []
    for p, n, t in samples:
        pred = allreduce_seconds(m, n, p)
        out.append({"nodes": p, "bytes": n, "measured_s": t, "predicted_s": pred, "error": pred / t - 1,
                    "fit": (p, n) in (fitted or set())})
    return out


def validate_codec(m: LinkModel, rows: list[dict[str, Any]],
                   rates: dict[str, tuple[float, float, float]]) -> list[dict[str, Any]]:
    """Return measured vs predicted compressed all-reduce time and speedup over FP32 for each row.

    The prediction is for the segment the row ran with (the tuner's choice, when the
    row records it): the model's own choice is for projections, the check is of the
    time of what ran. ``rates`` maps a codec spec to (encode B/s, decode B/s, wire
    ratio), as ``commwire.costmodel.codec_rates`` measures.
    """
    out = []
    for r in rows:
        enc, dec, ratio = rates[r["codec"]]
        pred = compressed_seconds(m, r["bytes"], r["nodes"], wire_ratio=ratio, enc_Bps=enc, dec_Bps=dec,
                                  segment=r.get("segment"))
        pred32 = allreduce_seconds(m, r["bytes"], r["nodes"])
        out.append({**r, "predicted_s": pred, "error": pred / r["codec_s"] - 1,
                    "speedup": r["fp32_s"] / r["codec_s"], "predicted_speedup": pred32 / pred})
    return out


# ------------------------------------------------------------------ training loops (bench glm)
def loop_terms(m: LinkModel, row: dict[str, Any], p: int) -> tuple[float, float]:
    """Return a loop's all-reduce latency and transfer time, over all its exchanges, on ``p`` nodes.

    On a token bucket the timed loop starts on an idle link with its bucket full: the
    first ``burst_bytes`` pass at memory speed, so the transfer is (k·V - burst)·β.
    """
    k = row["exchanges"]
    latency, transfer = (k * t for t in round_terms(m, row["bytes"], p))
    volume = k * sum(rounds(row["bytes"], p))
    if m.token_bucket and volume > 0:
        transfer *= max(0.0, volume - m.burst_bytes) / volume
    return latency, transfer


def glm_seconds(m: LinkModel, row: dict[str, Any], nodes: int | None = None,
                compute_s: float | None = None) -> float:
    """Return the modelled training-loop time of a ``load_glm`` row (at ``nodes``, with ``compute_s``)."""
    p = row["nodes"] if nodes is None else nodes
    work = row["compute_s"] if compute_s is None else compute_s
    latency, transfer = loop_terms(m, row, p)
    busy = work * m.compute_factor(p) + latency
    return max(busy, transfer) if m.token_bucket else busy + transfer


def fit_compute(m: LinkModel, rows: list[dict[str, Any]]) -> LinkModel:
    """Fit compute_scale and compute_share of ``m`` to measured loop times (least relative error).

    α, β and the all-reduce's sharing stay as fitted on all-reduce times; only how a
    loop's compute stretches when ranks run together is fitted here. compute_share
    needs rows on more ranks than cores; without them it stays 0.
    """
    if not rows:
        raise ValueError("no bench glm rows to fit the compute terms on; pass --glm files with rows at the "
                         "--glm-fit-nodes node counts")
    shared = m.cores is not None and any(r["nodes"] > m.cores for r in rows)
    scales = np.round(np.arange(0.5, 4.0001, 0.01), 2)
    shares = np.round(np.arange(0.0, 3.0001, 0.05), 2) if shared else np.array([0.0])
    work = np.array([r["compute_s"] for r in rows])  # per loop, as the rows give it
    lat, xfer = np.array([loop_terms(m, r, r["nodes"]) for r in rows]).T
    g = np.array([m.crowding(r["nodes"]) for r in rows])
    wall = np.array([r["wall_s"] for r in rows])
    best = (math.inf, 1.0, 0.0)
    for share in shares:
        busy = lat[None, :] + scales[:, None] * (work * g**share)[None, :]
        pred = np.maximum(busy, xfer) if m.token_bucket else busy + xfer
        err = np.sqrt(np.mean((pred / wall - 1) ** 2, axis=1))
        i = int(np.argmin(err))
        if err[i] < best[0] - 1e-12:
            best = (float(err[i]), float(scales[i]), float(share))
    return dataclasses.replace(m, compute_scale=best[1], compute_share=best[2])


def validate_glm(m: LinkModel, rows: list[dict[str, Any]],
                 fitted: set[tuple[int, str]]) -> list[dict[str, Any]]:
    """Return measured vs predicted loop time and speed-up over FP32 SGD (same data set, b, steps) per row."""
    key = ("dataset", "b", "steps", "nodes")
    base = {tuple(r[k] for k in key): r for r in rows if r["solver"] == "sgd" and r["precision"] == "fp32"}
    out = []
    for r in rows:
        pred = glm_seconds(m, r)
        ref = base.get(tuple(r[k] for k in key))
        out.append({**r, "predicted_s": pred, "error": pred / r["wall_s"] - 1,
                    "fit": (r["nodes"], r["solver"]) in fitted,
                    "speedup": ref["wall_s"] / r["wall_s"] if ref else math.nan,
                    "predicted_speedup": glm_seconds(m, ref) / pred if ref else math.nan})
    return out


def compute_at(rows: list[dict[str, Any]], nodes: int) -> float:
    """Return a loop's compute per rank at ``nodes``, from its measured node counts: a + b/P.

    The rows are one configuration (data set, solver, precision, s, b, steps) at several
    node counts; each rank's block has n/P columns, so the work falls as 1/P towards a
    fixed part (the solver's per-step overhead). One node count: its compute, scaled as
    if all of it were per column.
    """
    ps = np.array([r["nodes"] for r in rows], dtype=float)
    ts = np.array([r["compute_s"] for r in rows])
    if len(set(ps.tolist())) < 2:
        return float(ts.mean() * ps.mean() / nodes)
    coef = nonneg_lstsq(np.stack([1 / ts, 1 / (ps * ts)], axis=1))  # relative error: a/t + b/(P t) = 1
    return float(coef[0] + coef[1] / nodes)


# ------------------------------------------------------------------ reports
def _print_allreduce(model: LinkModel, args: argparse.Namespace, fitted: set[tuple[int, float]]) -> None:
    rows = validate(model, load_samples(args.validate), fitted)
    print("| nodes | size | measured ms | predicted ms | error | |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']} | {r['bytes']:.0f} B | {r['measured_s'] * 1e3:.3f} | "
              f"{r['predicted_s'] * 1e3:.3f} | {r['error']:+.0%} | {'fitted' if r['fit'] else 'held out'} |")
    for p in sorted({r["nodes"] for r in rows}):
        held = [abs(r["error"]) for r in rows if r["nodes"] == p and not r["fit"]]
        if held:
            print(f"{p} nodes: max |error| of {len(held)} held-out sizes {max(held):.0%}, "
                  f"mean {sum(held) / len(held):.0%}")


def _print_codecs(model: LinkModel, codec_rows: list[dict[str, Any]]) -> None:
    measured_rates = {spec: codec_rates(spec) for spec in sorted({r["codec"] for r in codec_rows})}
    print("\ncompressed all-reduce (codec throughput measured here, one process):")
    print("| nodes | size | codec | segment KiB | measured ms | predicted ms | error | speedup measured | "
          "predicted |\n|---|---|---|---|---|---|---|---|---|")
    checked = validate_codec(model, codec_rows, measured_rates)
    for r in checked:
        seg = f"{r['segment'] / 1024:.0f}" if r.get("segment") else "model's"
        print(f"| {r['nodes']} | {r['bytes']:.0f} B | {r['codec']} | {seg} | {r['codec_s'] * 1e3:.2f} | "
              f"{r['predicted_s'] * 1e3:.2f} | {r['error']:+.0%} | {r['speedup']:.2f}x | "
              f"{r['predicted_speedup']:.2f}x |")
    for p in sorted({r["nodes"] for r in checked}):
        errs = [abs(r["error"]) for r in checked if r["nodes"] == p]
        print(f"{p} nodes: max |error| of {len(errs)} compressed rows {max(errs):.0%}, "
              f"mean {sum(errs) / len(errs):.0%}")


def _print_glm(m: LinkModel, rows: list[dict[str, Any]], fitted: set[tuple[int, str]]) -> None:
    checked = validate_glm(m, rows, fitted)
    print(f"\ntraining loops (bench glm): compute measured alone on one rank's block, × "
          f"{m.compute_scale:.2f}·g^{m.compute_share:.2f} in the loop (fitted on the rows marked so)")
    print("| nodes | data set | solver | precision | s | µs/step measured | compute alone | predicted | error | "
          "speed-up measured | predicted | |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in checked:
        per = 1e6 / r["steps"]
        print(f"| {r['nodes']} | {r['dataset']} | {r['solver']} | {r['precision']} | {r['s']} | "
              f"{r['wall_s'] * per:.1f} | {r['compute_s'] * per:.1f} | {r['predicted_s'] * per:.1f} | "
              f"{r['error']:+.0%} | {r['speedup']:.2f}x | {r['predicted_speedup']:.2f}x | "
              f"{'fitted' if r['fit'] else 'held out'} |")
    for p in sorted({r["nodes"] for r in checked}):
        parts = []
        for label, fit_ in (("fitted", True), ("held-out", False)):
            errs = [abs(r["error"]) for r in checked if r["nodes"] == p and r["fit"] == fit_]
            if errs:
                parts.append(f"max |error| of {len(errs)} {label} loops {max(errs):.0%}, mean "
                             f"{sum(errs) / len(errs):.0%}")
        gaps = [abs(r["predicted_speedup"] / r["speedup"] - 1) for r in checked
                if r["nodes"] == p and r["solver"] != "sgd" and math.isfinite(r["speedup"])]
        print(f"{p} nodes: " + "; ".join(parts) + (f"; of the {len(gaps)} CA-SGD speed-ups {max(gaps):.0%}"
                                                   if gaps else ""))


def _project_glm(link: LinkModel, rows: list[dict[str, Any]], nodes: list[int]) -> None:
    """Print each training loop's projected µs per step, and speed-ups over FP32 SGD, at ``nodes``."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["solver"], r["precision"], r["s"], r["b"], r["steps"]), []).append(r)
    print("\nprojection of the training loops: µs per step (speed-up over FP32 SGD); compute per rank "
          "a + b/P from the measured node counts, one rank per node")
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        configs = [c for c in groups if c[0] == dataset]
        base = next((c for c in configs if c[1] == "sgd" and c[2] == "fp32"), None)
        print(f"\n| {dataset}: nodes | " + " | ".join(f"{c[1]} {c[2]} s={c[3]} b={c[4]}" for c in configs)
              + " |\n|---|" + "---|" * len(configs))
        for p in nodes:
            times = {c: glm_seconds(link, groups[c][0], nodes=p, compute_s=compute_at(groups[c], p)) / c[5]
                     for c in configs}
            cells = [f"{t * 1e6:.1f}" + (f" ({times[base] / t:.2f}x)" if base and c != base else "")
                     for c, t in times.items()]
            print(f"| {p} | " + " | ".join(cells) + " |")


# ------------------------------------------------------------------ command line
def _calibrated(args: argparse.Namespace) -> tuple[LinkModel, set[tuple[int, float]]]:
    """Fit the link on the --calibrate files; print what was fitted."""
    samples = load_samples(args.calibrate)
    if args.fit_sizes:
        keep = {parse_size(v) for v in args.fit_sizes.split(",") if v.strip()}
        samples = [smp for smp in samples if smp[1] in keep]
    fitted = {(p, n) for p, n, _ in samples}
    model = fit(samples, cores=args.cores or None, token_bucket=args.shaper == "tbf")
    if model.token_bucket:
        model = dataclasses.replace(model, burst_bytes=float(tbf_burst(parse_bandwidth(args.lab_bandwidth))))
    large = model.alpha if model.alpha_large is None else model.alpha_large
    links = (f"tbf-shaped: max(latency, transfer), bucket {model.burst_bytes:.0f} B" if model.token_bucket
             else "latency + transfer")
    print(f"fitted on {len(samples)} samples of {', '.join(args.calibrate)}: α = {model.alpha * 1e6:.1f} µs "
          f"(≤ {INJECT_BYTES} B), α_large = {large * 1e6:.1f} µs, β = {model.beta * 1e9:.3f} ns/B "
          f"({8 / model.beta / 1e9:.2f} Gbit/s); core sharing ({model.cores or 'none'} cores): "
          f"latency × g^{model.latency_share:.2f}, β × g^{model.bandwidth_share:.2f}, g = P/cores; links {links}")
    return model, fitted


def _fit_glm(model: LinkModel, args: argparse.Namespace, glm_rows: list[dict[str, Any]]) -> LinkModel:
    """Fit the loop compute terms on the --glm rows selected by --glm-fit-nodes/--glm-fit-solvers; print the check."""
    present = sorted({r["nodes"] for r in glm_rows})
    fit_nodes = ({int(v) for v in args.glm_fit_nodes.split(",") if v.strip()} if args.glm_fit_nodes
                 else set(present[:-1]) or set(present))
    solvers = {r["solver"] for r in glm_rows}
    fit_solvers = {v for v in args.glm_fit_solvers.split(",") if v.strip()} if args.glm_fit_solvers else solvers
    if not fit_solvers <= solvers:
        raise SystemExit(f"--glm-fit-solvers {args.glm_fit_solvers}: the --glm rows have solvers {sorted(solvers)}")
    fitted = {(p, s) for p in fit_nodes for s in fit_solvers}
    model = fit_compute(model, [r for r in glm_rows if (r["nodes"], r["solver"]) in fitted])
    _print_glm(model, glm_rows, fitted)
    return model


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``python benchmarks/calibrate.py``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/calibrate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", nargs="*", default=[], help="bench allreduce --json files to fit α, β on")
    parser.add_argument("--validate", nargs="*", default=[], help="files whose times the fitted model predicts")
    parser.add_argument("--fit-sizes", help="fit only on these sizes of the calibration files (e.g. 16,4K,256K,16M); "
                        "the others are held out and predicted")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="cores the measured ranks shared (default: this machine's; 0: one rank per node)")
    parser.add_argument("--shaper", choices=("tbf", "none"), default="tbf",
                        help="how the calibration runs' links were limited: tbf (commwire lab, the default) "
                             "or none (loopback, a real network)")
    parser.add_argument("--glm", nargs="*", default=[],
                        help="bench glm --json files: fit how loop compute stretches on shared cores, predict "
                             "their step times and speed-ups, and project them")
    parser.add_argument("--glm-fit-nodes",
                        help="node counts of the --glm rows to fit the compute terms on (default: all but the "
                             "largest, which is held out and predicted)")
    parser.add_argument("--glm-fit-solvers",
                        help="solvers of the --glm rows to fit on (e.g. sgd: the CA-SGD rows are held out and "
                             "predicted); default: all")
    parser.add_argument("--lab-bandwidth", default="1gbit",
                        help="the calibration lab's link bandwidth (with --shaper tbf: its token bucket, which a "
                             "timed training loop starts with full, holds tbf_burst of it; default 1gbit)")
    parser.add_argument("--nodes", default="2,4,8,16,64,256,1024", help="node counts to project to")
    parser.add_argument("--bandwidth", help="link bandwidth (e.g. 100gbit); default: the fitted β")
    parser.add_argument("--latency", help="per-message latency (e.g. 5us); default: the fitted α")
    parser.add_argument("--size", default="64M", help="all-reduce size to project")
    parser.add_argument("--codecs", default="fp8-e4m3,nvfp4", help="codecs to project (throughput measured here)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Calibrate/validate the model on measurement files, or project to many nodes."""
    args = build_parser().parse_args(argv)
    if args.cores < 0:
        raise SystemExit(f"--cores {args.cores} is negative; give the cores the ranks shared, or 0 for none")
    model, fitted = _calibrated(args) if args.calibrate else (None, set())
    if args.validate:
        if model is None:
            raise SystemExit("--validate needs --calibrate files to fit the model first")
        _print_allreduce(model, args, fitted)
        codec_rows = load_codec_rows(args.validate)
        if codec_rows:
            _print_codecs(model, codec_rows)
    glm_rows = load_glm(args.glm) if args.glm else []
    if glm_rows:
        if model is None:
            raise SystemExit("--glm needs --calibrate files to fit the link model first")
        model = _fit_glm(model, args, glm_rows)
    if model is not None:
        model = model.alone()  # a cluster: one rank per node
    alpha = parse_latency(args.latency) if args.latency else (model.alpha if model else None)
    beta = 8 / parse_bandwidth(args.bandwidth) if args.bandwidth else (model.beta if model else None)
    if alpha is None or beta is None:
        if not args.validate:
            raise SystemExit("give --calibrate files, or both --bandwidth and --latency, to project")
        return 0
    large = alpha if args.latency or model is None else model.alpha_large
    link = LinkModel(alpha=alpha, alpha_large=large, beta=beta)
    nodes = [int(v) for v in args.nodes.split(",")]
    print("\n" + projection(link, parse_size(args.size), nodes, [c for c in args.codecs.split(",") if c], args.size))
    if glm_rows:
        _project_glm(link, glm_rows, nodes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
