"""Latency–bandwidth (α–β) cost model: calibrate on measurements, validate, project to many nodes.

Model of one all-reduce of n bytes on P nodes, following MPICH's algorithms:
recursive doubling up to 2 KiB (R = ⌈log2 P⌉ rounds, V = R·n bytes sent per
rank), reduce-scatter + all-gather above (R = 2⌈log2 P⌉, V = 2(P−1)/P · n):

    T_fp32(n, P) = R·(α + α_s·f) + V·(β + β_s·f),   f = max(0, 1 − cores/P)

f is the share of time a partner rank waits for a core when P ranks share
``cores`` cores — the lab runs every emulated host on this machine; on a
cluster (one rank per node) f = 0 and only α and β remain. The compressed
all-reduce (wire ratio w, codec throughputs measured here) is pipelined:

    T_codec(n, P) = max(wire, cpu) + (wire + cpu)/segments,
    wire = segments·(P−1+⌈log2 P⌉)·(α + α_s·f) + 2(P−1)/P · w·n·(β + β_s·f),
    cpu  = (n/enc + n(2−1/P)/dec) · max(1, P/cores)

α, β, α_s, β_s are fitted (non-negative least squares on relative error) to
FP32 all-reduce times measured by ``commwire bench allreduce --json``; sizes
or node counts left out of the fit are predicted and the error reported.

Run:
    commwire bench project --calibrate lab2.json lab4.json --fit-sizes 16,4K,256K,16M \
        --validate lab2.json lab4.json lab8.json
    commwire bench project --nodes 2,16,256,1024 --bandwidth 100gbit --latency 5us --size 64M
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["LinkModel", "fit", "allreduce_seconds", "compressed_seconds", "validate", "main"]


SHORT_BYTES = 2048
"""Up to this size MPICH all-reduces by recursive doubling (log2 P rounds of the whole
message); above it by reduce-scatter + all-gather (2 log2 P rounds, 2(P-1)/P of it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModel:
    """Per-round latency α (s) and per-byte time β (s/B) of the network, plus core sharing.

    When P ranks share ``cores`` cores (the lab: every emulated host runs on this
    machine), a rank's partner is descheduled a fraction f = 1 - cores/P of the time,
    and each round and each byte costs that much more: α + α_shared·f and
    β + β_shared·f. On a real cluster (one rank per node) ``cores`` is None and f = 0.
    """

    alpha: float
    beta: float
    alpha_shared: float = 0.0
    beta_shared: float = 0.0
    cores: int | None = None

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta <= 0 or self.alpha_shared < 0 or self.beta_shared < 0:
            raise ValueError(f"alpha={self.alpha}, alpha_shared={self.alpha_shared} and beta_shared="
                             f"{self.beta_shared} must be >= 0 and beta={self.beta} > 0")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores={self.cores!r}; use a positive int, or None for one rank per node")

    def sharing(self, p: int) -> float:
        """Return f = 1 - cores/P, the fraction of time a partner rank waits for a core (0 if not shared)."""
        return max(0.0, 1.0 - self.cores / p) if self.cores else 0.0

    def round_s(self, p: int) -> float:
        """Return the time of one message round on ``p`` ranks."""
        return self.alpha + self.alpha_shared * self.sharing(p)

    def byte_s(self, p: int) -> float:
        """Return the time per byte on ``p`` ranks."""
        return self.beta + self.beta_shared * self.sharing(p)

    def alone(self) -> LinkModel:
        """Return the same network with one rank per node (no core sharing): what a cluster has."""
        return LinkModel(alpha=self.alpha, beta=self.beta)



def _steps(p: int) -> int:
    return max(1, math.ceil(math.log2(p))) if p > 1 else 0


def _terms(nbytes: float, p: int) -> tuple[float, float]:
    """Return (rounds, bytes each rank sends) of MPICH's all-reduce of ``nbytes`` on ``p`` ranks."""
    if p <= 1:
        return 0.0, 0.0
    if nbytes <= SHORT_BYTES:
        return float(_steps(p)), _steps(p) * nbytes
    return 2.0 * _steps(p), 2 * (p - 1) / p * nbytes


def allreduce_seconds(m: LinkModel, nbytes: float, p: int) -> float:
    """Return the modelled FP32 all-reduce time of ``nbytes`` on ``p`` nodes."""
    rounds, volume = _terms(nbytes, p)
    return rounds * m.round_s(p) + volume * m.byte_s(p)


PIPELINE_BYTES = 4 << 20
"""FP32 bytes per pipeline segment of the compressed all-reduce (its default)."""


def compressed_seconds(m: LinkModel, nbytes: float, p: int, *, wire_ratio: float, enc_Bps: float,
                       dec_Bps: float) -> float:
    """Return the modelled compressed all-reduce time (pipelined Alltoallv + Allgatherv of payloads).

    Per rank: encode n bytes of FP32 (the others' chunks, then its reduced one), decode
    n(2 - 1/P); the wire carries 2(P-1)/P · w·n.
    Segments overlap codec work with the wire, so the time is the larger of the two plus
    one segment of each (pipeline fill and drain). Codec work slows by P/cores when
    ranks share cores.
    """
    cpu = nbytes / enc_Bps + nbytes * (2 - 1 / p) / dec_Bps
    if p <= 1:
        return nbytes / enc_Bps + nbytes / dec_Bps
    if m.cores:
        cpu *= max(1.0, p / m.cores)
    segments = max(1, math.ceil(nbytes / PIPELINE_BYTES))
    wire = (segments * (p - 1 + _steps(p)) * m.round_s(p)
            + 2 * (p - 1) / p * wire_ratio * nbytes * m.byte_s(p))
    return max(wire, cpu) + (wire + cpu) / segments


def fit(samples: list[tuple[int, float, float]], cores: int | None = None) -> LinkModel:
    """Fit the model to (nodes, bytes, seconds) samples, minimising relative error.

    With ``cores`` (the cores the measured ranks shared), the core-sharing terms are
    fitted too when the samples include node counts above it; coefficients are kept
    non-negative (a negative one is dropped and the rest refitted).
    """
    probe = LinkModel(alpha=0.0, beta=1.0, cores=cores)
    rows = []
    for p, n, t in samples:
        if p > 1 and t > 0:
            r, v = _terms(n, p)
            f = probe.sharing(p)
            rows.append(([r, r * f, v, v * f], t))
    if len(rows) < 2:
        raise ValueError(f"need at least 2 samples on more than one node to fit, got {len(rows)}")
    a = np.array([[c / t for c in cols] for cols, t in rows])
    active = [i for i in range(4) if np.any(a[:, i] > 0)]
    coef = np.zeros(4)
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], np.ones(len(rows)), rcond=None)
        if np.all(sol >= 0):
            coef[active] = sol
            break
        active = [i for i, v in zip(active, sol) if v >= 0]  # drop the negative terms, refit the rest
    if coef[2] <= 0:
        raise ValueError("the samples do not determine a bandwidth; include messages of a few MB")
    return LinkModel(alpha=float(coef[0]), alpha_shared=float(coef[1]), beta=float(coef[2]),
                     beta_shared=float(coef[3]), cores=cores)


def _load(paths: list[str]) -> list[tuple[int, float, float]]:
    samples = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            rows = json.load(fh)
        samples += [(int(r["ranks"]), float(r["bytes"]), float(r["raw_us"]) * 1e-6) for r in rows]
    return samples


def validate(m: LinkModel, samples: list[tuple[int, float, float]],
             fitted: set[tuple[int, float]] | None = None) -> list[dict[str, Any]]:
    """Return measured vs predicted FP32 all-reduce time for each sample (``fit``: was it fitted on)."""
    out = []
    for p, n, t in samples:
        pred = allreduce_seconds(m, n, p)
        out.append({"nodes": p, "bytes": n, "measured_s": t, "predicted_s": pred, "error": pred / t - 1,
                    "fit": (p, n) in (fitted or set())})
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
    parser.add_argument("--fit-sizes", help="fit only on these sizes of the calibration files (e.g. 16,4K,256K,16M); "
                        "the others are held out and predicted")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="cores the measured ranks shared (default: this machine's; 0: one rank per node)")
    parser.add_argument("--nodes", default="2,4,8,16,64,256,1024", help="node counts to project to")
    parser.add_argument("--bandwidth", help="link bandwidth (e.g. 100gbit); default: the fitted β")
    parser.add_argument("--latency", help="per-message latency (e.g. 5us); default: the fitted α")
    parser.add_argument("--size", default="64M", help="all-reduce size to project")
    parser.add_argument("--codecs", default="fp8-e4m3,nvfp4", help="codecs to project (throughput measured here)")
    args = parser.parse_args(argv)

    if args.cores < 0:
        raise SystemExit(f"--cores {args.cores} is negative; give the cores the ranks shared, or 0 for none")
    model, fitted = None, set()
    if args.calibrate:
        samples = _load(args.calibrate)
        if args.fit_sizes:
            keep = {parse_size(v) for v in args.fit_sizes.split(",") if v.strip()}
            samples = [smp for smp in samples if smp[1] in keep]
        fitted = {(p, n) for p, n, _ in samples}
        model = fit(samples, cores=args.cores or None)
        print(f"fitted on {len(samples)} samples of {', '.join(args.calibrate)}: α = {model.alpha * 1e6:.1f} µs, "
              f"β = {model.beta * 1e9:.3f} ns/B ({8 / model.beta / 1e9:.2f} Gbit/s); core sharing "
              f"({model.cores or 'none'} cores): +{model.alpha_shared * 1e6:.1f} µs and "
              f"+{model.beta_shared * 1e9:.3f} ns/B times f = 1 - cores/P")
    if args.validate:
        if model is None:
            raise SystemExit("--validate needs --calibrate files to fit the model first")
        rows = validate(model, _load(args.validate), fitted)
        print("| nodes | size | measured ms | predicted ms | error | |\n|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['nodes']} | {r['bytes']:.0f} B | {r['measured_s'] * 1e3:.3f} | "
                  f"{r['predicted_s'] * 1e3:.3f} | {r['error']:+.0%} | {'fitted' if r['fit'] else 'held out'} |")
        for p in sorted({r["nodes"] for r in rows}):
            held = [abs(r["error"]) for r in rows if r["nodes"] == p and not r["fit"]]
            if held:
                print(f"{p} nodes: max |error| of {len(held)} held-out sizes {max(held):.0%}, "
                      f"mean {sum(held) / len(held):.0%}")
    if model is not None:
        model = model.alone()  # a cluster: one rank per node
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
