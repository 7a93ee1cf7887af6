"""Latency–bandwidth (α–β) cost model: calibrate on measurements, validate, project to many nodes.

Model of one all-reduce of n bytes on P nodes (MPICH's large-message
algorithm, reduce-scatter + all-gather, and its log-depth small-message one):

    T_fp32(n, P)  = 2·⌈log2 P⌉·α + 2·(P−1)/P · n·β

and of commwire's compressed all-reduce with wire ratio w (bytes on the wire
per FP32 byte) and measured codec throughputs:

    T_codec(n, P) = (P−1+⌈log2 P⌉)·α + 2·(P−1)/P · w·n·β + n/enc·(1+1/P) + n/dec·(1+1/P)

(codec time counted in full: no overlap is assumed). α and β are fitted by
least squares on relative error to FP32 all-reduce times measured by
``commwire bench allreduce --json`` on some node counts, and the fit is
checked against measurements on others.

Run:
    commwire bench project --calibrate lab2.json --validate lab4.json lab8.json
    commwire bench project --nodes 2,16,256,1024 --bandwidth 100gbit --latency 5us --size 64M
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["LinkModel", "fit", "allreduce_seconds", "compressed_seconds", "validate", "main"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModel:
    """Per-message latency α (s) and per-byte time β (s/B) of the network."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta <= 0:
            raise ValueError(f"alpha={self.alpha} must be >= 0 and beta={self.beta} > 0")


def _steps(p: int) -> int:
    return max(1, math.ceil(math.log2(p))) if p > 1 else 0


def allreduce_seconds(m: LinkModel, nbytes: float, p: int) -> float:
    """Return the modelled FP32 all-reduce time of ``nbytes`` on ``p`` nodes."""
    if p <= 1:
        return 0.0
    return 2 * _steps(p) * m.alpha + 2 * (p - 1) / p * nbytes * m.beta


def compressed_seconds(m: LinkModel, nbytes: float, p: int, *, wire_ratio: float, enc_Bps: float,
                       dec_Bps: float) -> float:
    """Return the modelled compressed all-reduce time (Alltoall + Allgather of payloads, codec in full)."""
    if p <= 1:
        return nbytes / enc_Bps + nbytes / dec_Bps
    transfer = (p - 1 + _steps(p)) * m.alpha + 2 * (p - 1) / p * wire_ratio * nbytes * m.beta
    codec = (nbytes / enc_Bps + nbytes / dec_Bps) * (1 + 1 / p)
    return transfer + codec


def fit(samples: list[tuple[int, float, float]]) -> LinkModel:
    """Fit α, β to (nodes, bytes, seconds) samples, minimising relative error."""
    rows = [(2 * _steps(p), 2 * (p - 1) / p * n, t) for p, n, t in samples if p > 1 and t > 0]
    if len(rows) < 2:
        raise ValueError(f"need at least 2 samples on more than one node to fit, got {len(rows)}")
    a = np.array([[c / t, b / t] for c, b, t in rows])
    coef, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    alpha, beta = (max(float(v), 0.0) for v in coef)
    if beta <= 0:
        raise ValueError("the samples do not determine a bandwidth; include messages of a few MB")
    return LinkModel(alpha=alpha, beta=beta)


def _load(paths: list[str]) -> list[tuple[int, float, float]]:
    samples = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            rows = json.load(fh)
        samples += [(int(r["ranks"]), float(r["bytes"]), float(r["raw_us"]) * 1e-6) for r in rows]
    return samples


def validate(m: LinkModel, samples: list[tuple[int, float, float]]) -> list[dict[str, Any]]:
    """Return measured vs predicted FP32 all-reduce time for each sample."""
    out = []
    for p, n, t in samples:
        pred = allreduce_seconds(m, n, p)
        out.append({"nodes": p, "bytes": n, "measured_s": t, "predicted_s": pred, "error": pred / t - 1})
    return out


def _codec_rates(spec: str, nbytes: int = 16 << 20) -> tuple[float, float, float]:
    """Measure this machine's encode/decode throughput (B/s of FP32) and wire ratio for ``spec``."""
    import time

    from ..codecs import get

    codec = get(spec)
    x = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    buf = np.empty(codec.wire_nbytes(x.size), dtype=np.uint8)
    out = np.empty_like(x)
    codec.encode_into(x, buf)
    codec.decode_from(buf, x.size, out=out)  # compile and warm up
    enc, dec = [], []
    for _ in range(5):
        t = time.perf_counter()
        codec.encode_into(x, buf)
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        codec.decode_from(buf, x.size, out=out)
        dec.append(time.perf_counter() - t)
    return nbytes / min(enc), nbytes / min(dec), buf.size / nbytes


def _parse_latency(text: str) -> float:
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * units[unit]
            except ValueError:
                break
    raise ValueError(f"latency {text!r} is not like 5us, 150us or 1ms")


def main(argv: list[str] | None = None) -> int:
    """Calibrate/validate the model on measurement files, or project to many nodes."""
    from ..lab.bandwidth import parse_bandwidth
    from .allreduce import parse_size

    parser = argparse.ArgumentParser(prog="commwire bench project", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", nargs="*", default=[], help="bench allreduce --json files to fit α, β on")
    parser.add_argument("--validate", nargs="*", default=[], help="files whose times the fitted model predicts")
    parser.add_argument("--nodes", default="2,4,8,16,64,256,1024", help="node counts to project to")
    parser.add_argument("--bandwidth", help="link bandwidth (e.g. 100gbit); default: the fitted β")
    parser.add_argument("--latency", help="per-message latency (e.g. 5us); default: the fitted α")
    parser.add_argument("--size", default="64M", help="all-reduce size to project")
    parser.add_argument("--codecs", default="fp8-e4m3,nvfp4", help="codecs to project (throughput measured here)")
    args = parser.parse_args(argv)

    model = fit(_load(args.calibrate)) if args.calibrate else None
    if model is not None:
        print(f"fitted on {', '.join(args.calibrate)}: α = {model.alpha * 1e6:.1f} µs, "
              f"β = {model.beta * 1e9:.3f} ns/B ({8 / model.beta / 1e9:.2f} Gbit/s)")
    if args.validate:
        if model is None:
            raise SystemExit("--validate needs --calibrate files to fit the model first")
        rows = validate(model, _load(args.validate))
        print("| nodes | size | measured ms | predicted ms | error |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['nodes']} | {r['bytes']:.0f} B | {r['measured_s'] * 1e3:.3f} | "
                  f"{r['predicted_s'] * 1e3:.3f} | {r['error']:+.0%} |")
        big = [abs(r["error"]) for r in rows if r["bytes"] >= 1 << 20]
        if big:
            print(f"max |error| at >= 1 MiB: {max(big):.0%}; over all sizes: {max(abs(r['error']) for r in rows):.0%}")
    alpha = _parse_latency(args.latency) if args.latency else (model.alpha if model else None)
    beta = 8 / parse_bandwidth(args.bandwidth) if args.bandwidth else (model.beta if model else None)
    if alpha is None or beta is None:
        if not args.validate:
            raise SystemExit("give --calibrate files, or both --bandwidth and --latency, to project")
        return 0
    link = LinkModel(alpha=alpha, beta=beta)
    nbytes = parse_size(args.size)
    specs = [c for c in args.codecs.split(",") if c]
    rates = {spec: _codec_rates(spec) for spec in specs}
    head = "| nodes | FP32 ms | " + " | ".join(f"{s} ms | {s} speedup" for s in specs) + " |"
    print(f"\nprojection: {args.size} all-reduce, α = {alpha * 1e6:.1f} µs, {8 / beta / 1e9:.2f} Gbit/s per link; "
          "codec throughput measured on this machine, one rank per node")
    print(head + "\n|" + "---|" * (2 + 2 * len(specs)))
    for p in (int(v) for v in args.nodes.split(",")):
        t32 = allreduce_seconds(link, nbytes, p)
        cells = [f"{p}", f"{t32 * 1e3:.2f}"]
        for spec in specs:
            enc, dec, ratio = rates[spec]
            tc = compressed_seconds(link, nbytes, p, wire_ratio=ratio, enc_Bps=enc, dec_Bps=dec)
            cells += [f"{tc * 1e3:.2f}", f"{t32 / tc:.2f}x" if tc > 0 else "-"]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
