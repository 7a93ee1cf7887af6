"""Latency–bandwidth (α–β) cost model: calibrate on measurements, validate, project to many nodes.

Model of one FP32 all-reduce of n bytes on P nodes, following MPICH's own
algorithm choice (its coll_selection.json): recursive doubling when the message
is at most 8 bytes or has fewer elements than the largest power of two ≤ P
(log2 P rounds of the whole message), otherwise reduce-scatter + all-gather
(rounds of n/2, n/4, …, n/P and back; 2(P−1)/P · n bytes sent per rank).
A non-power-of-two P adds two rounds of the whole message. Each round costs

    α        for a message of at most ``INJECT_BYTES`` (libfabric's tcp provider
             sends it inline, with no completion to wait for),
    α_large  for a longer one,

and the bytes cost β each. On a real link the two add up: T = L + V·β. The lab's
token bucket (tbf) lets a message through at memory speed while it holds
tokens, so a loop of small all-reduces never waits for bandwidth and a large
one always does: on the lab T = max(L, V·β).

When P ranks share ``cores`` cores (the lab: every emulated host runs on this
machine) each rank waits for g = P/cores ranks per core to be scheduled, and the
kernel's TCP work competes for the same cores, so

    L → L · g^κ_α,   β → β · g^κ_β   (g = max(1, P/cores), κ fitted),

the latter only for messages above 64 KiB (``SAVED_BYTES``): libfabric's tcp
provider takes in smaller ones even before their receive is posted, while a
longer one waits for its receiver to be scheduled.

A projection to a cluster (one rank per node, real links) drops g and the
token bucket: ``LinkModel.alone``. The compressed all-reduce (wire ratio w,
codec throughputs measured here) is pipelined:

    T_codec(n, P) = max(wire, cpu)·(s−1)/s + (wire + cpu)/s   (s pipeline segments),
    wire = s·2(P−1)·α(message)·g^κ_α + 2(P−1)/P · w·n·β·g^κ_β,
    cpu  = (n/enc + n(2−1/P)/dec) · g,

with s chosen, as the all-reduce's tuner does, as the fastest of its segment sizes.

α, α_large, β are fitted by least squares on relative error (non-negative) to
FP32 all-reduce times measured by ``commwire bench allreduce --json``; κ_α, κ_β
by a grid search around it. Sizes or node counts left out of the fit are
predicted and the error reported. A compressed row is checked at the segment
its tuner chose.

A training loop (``commwire bench glm --json``: each loop also timed alone on
one rank's block, c) is a sequence of exchanges, each compute then an all-reduce:

    T_loop = max(k·(c·μ·g^κ_c + L), (k·V − burst)·β)   on the lab,
    T_loop = k·(c + L + V·β)                           on a cluster,

for k exchanges: the lab's token bucket refills while ranks compute, and a timed
loop starts on an idle link with its bucket (``burst``) full. μ and κ_c are
fitted on the loops of some node counts and solvers (``--glm-fit-nodes``,
``--glm-fit-solvers``) and the others predicted; ranks that compute while others
spin in MPI on the same cores stretch c beyond g. The projection takes c per
rank as a + b/P (a fixed part and the n/P columns), fitted on the measured node
counts.

CA-SGD's s (``GLM(s="auto")``, ``commwire.glm._auto``): at fit time the solver
all-reduces each candidate's payload a few times on its own ranks, fits α, α_large,
β with ``fit_link`` (whichever of the tbf and plain shapes fits better), times each
candidate's local work per exchange c_s (gather, Gram, recurrence, update), and
takes the s of least time per inner step, ``casgd_step_seconds``:

    T(s) = step_seconds(words(s, b)·itemsize, c_s) / s,   words(s, b) = s·b + s(s−1)/2 · b².

Run:
    commwire bench project --calibrate lab2.json lab4.json lab8.json --fit-sizes 16,4K,256K,16M \
        --validate lab2.json lab4.json lab8.json
    commwire bench project --calibrate lab2.json lab4.json lab8.json --glm glm2.json glm4.json glm8.json \
        --glm-fit-nodes 2,4
    commwire bench project --nodes 2,16,256,1024 --bandwidth 100gbit --latency 5us --size 64M
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..codecs.collective import PEER_CHOICES, segment_bytes_at  # the all-reduce's own segment rule

__all__ = ["LinkModel", "fit", "allreduce_seconds", "compressed_seconds", "validate", "validate_codec", "main",
           "INJECT_BYTES", "segment_bytes", "step_seconds", "glm_seconds", "fit_compute", "validate_glm",
           "compute_at", "sstep_words", "casgd_step_seconds", "choose_s", "fit_link"]


INJECT_BYTES = 128
"""Messages up to this size are sent inline by libfabric's tcp provider (its inject size)."""
SAVED_BYTES = 64 << 10
"""libfabric tcp buffers unexpected messages up to this size (``max_saved_size``); a longer one
waits until its receive is posted, so it feels core sharing (see ``LinkModel.byte_s``)."""
SHORT_BYTES = 8
"""Up to this size MPICH always all-reduces by recursive doubling (coll_selection.json)."""
_ELEM = 4  # bytes per element: the model is of float32 all-reduces


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModel:
    """Per-round latencies α (s), per-byte time β (s/B), core sharing and the lab's token bucket.

    ``alpha`` is a round with an inline message (≤ ``INJECT_BYTES``), ``alpha_large``
    one with a longer message (None: the same as ``alpha``). With ``cores`` (the
    cores P ranks share), latencies scale by g^latency_share and β by
    g^bandwidth_share, g = max(1, P/cores), and a training loop's compute by
    compute_scale · g^compute_share (see ``step_seconds``). ``token_bucket``: the
    link is a tbf shaper (the lab), so latency and transfer overlap, T = max(L, V·β),
    and ``burst_bytes`` is its bucket: a loop that starts on an idle link sends that
    many bytes at memory speed first (``glm_seconds``).
    """

    alpha: float
    beta: float
    alpha_large: float | None = None
    cores: int | None = None
    latency_share: float = 0.0
    bandwidth_share: float = 0.0
    token_bucket: bool = False
    compute_scale: float = 1.0
    compute_share: float = 0.0
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta <= 0 or (self.alpha_large is not None and self.alpha_large < 0):
            raise ValueError(f"alpha={self.alpha} and alpha_large={self.alpha_large} must be >= 0 "
                             f"and beta={self.beta} > 0")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores={self.cores!r}; use a positive int, or None for one rank per node")
        if self.latency_share < 0 or self.bandwidth_share < 0 or self.compute_share < 0:
            raise ValueError(f"latency_share={self.latency_share}, bandwidth_share={self.bandwidth_share} and "
                             f"compute_share={self.compute_share} must be >= 0")
        if self.burst_bytes < 0:
            raise ValueError(f"burst_bytes={self.burst_bytes} must be >= 0 (0: no bucket credit)")
        if self.compute_scale <= 0:
            raise ValueError(f"compute_scale={self.compute_scale} must be > 0 (1: compute as measured alone)")

    def crowding(self, p: int) -> float:
        """Return g = max(1, P/cores), ranks per core (1 when not shared)."""
        return max(1.0, p / self.cores) if self.cores else 1.0

    def round_s(self, p: int, message_bytes: float) -> float:
        """Return the time of one round of ``message_bytes`` messages on ``p`` ranks (latency only)."""
        large = self.alpha if self.alpha_large is None else self.alpha_large
        base = self.alpha if message_bytes <= INJECT_BYTES else large
        return base * self.crowding(p) ** self.latency_share

    def byte_s(self, p: int, message_bytes: float = math.inf) -> float:
        """Return the time per byte of ``message_bytes`` messages on ``p`` ranks.

        Core sharing slows only messages above ``SAVED_BYTES``: smaller ones the
        receiver's provider takes in even before the receive is posted.
        """
        shared = message_bytes > SAVED_BYTES
        return self.beta * (self.crowding(p) ** self.bandwidth_share if shared else 1.0)

    def compute_factor(self, p: int) -> float:
        """Return how much longer a rank's compute takes in a loop of ``p`` ranks than alone."""
        return self.compute_scale * self.crowding(p) ** self.compute_share

    def alone(self) -> LinkModel:
        """Return the same network with one rank per node and real links: what a cluster has."""
        return LinkModel(alpha=self.alpha, alpha_large=self.alpha_large, beta=self.beta)


def _steps(p: int) -> int:
    return max(1, math.ceil(math.log2(p))) if p > 1 else 0


def _rounds(nbytes: float, p: int) -> list[float]:
    """Return the message size of each round of MPICH's all-reduce of ``nbytes`` (float32) on ``p`` ranks."""
    if p <= 1:
        return []
    pof2 = 1 << int(math.floor(math.log2(p)))
    steps = int(math.log2(pof2))
    if nbytes <= SHORT_BYTES or nbytes // _ELEM < pof2:
        msgs = [float(nbytes)] * steps
    else:
        half = [nbytes / 2**k for k in range(1, steps + 1)]
        msgs = half + half[::-1]
    if pof2 != p:  # the ranks beyond pof2 hand their data to a partner first and get the result last
        msgs = [float(nbytes)] + msgs + [float(nbytes)]
    return msgs


def _counts(msgs: list[float]) -> tuple[int, int, float]:
    """Return (inline rounds, longer rounds, bytes each rank sends) of rounds of ``msgs`` bytes."""
    inline = sum(m <= INJECT_BYTES for m in msgs)
    return inline, len(msgs) - inline, float(sum(msgs))


def _terms(nbytes: float, p: int) -> tuple[int, int, float]:
    """Return (inline rounds, longer rounds, bytes each rank sends) of the all-reduce."""
    return _counts(_rounds(nbytes, p))


def _combine(m: LinkModel, latency: float, transfer: float) -> float:
    return max(latency, transfer) if m.token_bucket else latency + transfer


def _round_terms(m: LinkModel, nbytes: float, p: int) -> tuple[float, float]:
    """Return the latency and the transfer time of MPICH's all-reduce of ``nbytes`` on ``p`` nodes."""
    rounds = _rounds(nbytes, p)
    return sum(m.round_s(p, b) for b in rounds), sum(b * m.byte_s(p, b) for b in rounds)


def allreduce_seconds(m: LinkModel, nbytes: float, p: int) -> float:
    """Return the modelled FP32 all-reduce time of ``nbytes`` on ``p`` nodes."""
    return _combine(m, *_round_terms(m, nbytes, p))


def segment_bytes(p: int, wire_ratio: float, peer_bytes: int) -> float:
    """Return the FP32 bytes of one pipeline segment: ``peer_bytes`` of payload to each of ``p`` ranks."""
    return float(segment_bytes_at(wire_ratio, p, peer_bytes))


def _pipelined_seconds(m: LinkModel, nbytes: float, p: int, wire_ratio: float, cpu: float, seg: float) -> float:
    segments = max(1, math.ceil(nbytes / seg))
    chunk = wire_ratio * min(nbytes, seg) / p
    wire = _combine(m, segments * 2 * (p - 1) * m.round_s(p, chunk),
                    2 * (p - 1) / p * wire_ratio * nbytes * m.byte_s(p, chunk))
    # s segments of wire/s and cpu/s each: the first fills the pipe, the slower stage sets the pace.
    return max(wire, cpu) * (segments - 1) / segments + (wire + cpu) / segments


def compressed_seconds(m: LinkModel, nbytes: float, p: int, *, wire_ratio: float, enc_Bps: float,
                       dec_Bps: float, peer_bytes: int | None = None, segment: float | None = None) -> float:
    """Return the modelled compressed all-reduce time (two pipelined Alltoallv phases of payloads).

    Per rank: encode n bytes of FP32 (the others' chunks, then its reduced one), decode
    n(2 - 1/P); the wire carries 2(P-1)/P · w·n. Codec work slows by g = P/cores when
    ranks share cores. Segments overlap codec work with the wire, so the time is the
    larger of the two for all segments but one, plus one segment of both (pipeline fill
    and drain). The segment is the fastest of ``PEER_CHOICES`` payload bytes per peer,
    as the all-reduce's own tuner picks it; ``peer_bytes`` fixes it instead, and
    ``segment`` (FP32 bytes, as ``bench allreduce`` reports the tuner's choice) too.
    """
    cpu = nbytes / enc_Bps + nbytes * (2 - 1 / p) / dec_Bps
    if p <= 1:
        return nbytes / enc_Bps + nbytes / dec_Bps
    cpu *= m.crowding(p)
    if segment:
        return _pipelined_seconds(m, nbytes, p, wire_ratio, cpu, float(segment))
    choices = (peer_bytes,) if peer_bytes else PEER_CHOICES
    return min(_pipelined_seconds(m, nbytes, p, wire_ratio, cpu, segment_bytes(p, wire_ratio, peer))
               for peer in choices)


def step_seconds(m: LinkModel, nbytes: float, p: int, compute_s: float) -> float:
    """Return the modelled time of one exchange of a training loop on ``p`` nodes.

    Each rank computes for ``compute_s`` (its block's work, measured alone), then
    all-reduces ``nbytes`` of float32 with MPICH's algorithm. The compute stretches by
    ``m.compute_factor(p)`` on shared cores and sits on the critical path with the
    all-reduce's latency; on the lab's token bucket the link refills while ranks
    compute, so the step is max(compute + latency, transfer), on a real link their sum.
    """
    latency, transfer = _round_terms(m, nbytes, p)
    return _combine(m, compute_s * m.compute_factor(p) + latency, transfer)


def sstep_words(s: int, b: int) -> int:
    """Return the numbers one CA-SGD exchange of s steps of b rows sends: s*b margins + s(s-1)/2 b^2 Gram."""
    return s * b + (s * (s - 1) // 2) * b * b


def casgd_step_seconds(m: LinkModel, p: int, b: int, s: int, compute_s: float, itemsize: int = 4) -> float:
    """Return the modelled time per inner step of CA-SGD at ``s`` in a long loop on ``p`` nodes.

    One exchange per s steps: ``compute_s`` of local work (gather, Gram, recurrence,
    update, as measured for this s), then the all-reduce of ``sstep_words(s, b)``
    numbers of ``itemsize`` bytes (``step_seconds``). The loop is long, so a token
    bucket's initial credit (``burst_bytes``) is left out.
    """
    return step_seconds(m, sstep_words(s, b) * itemsize, p, compute_s) / s


def choose_s(m: LinkModel, p: int, b: int, compute_s: dict[int, float],
             itemsize: int = 4, margin: float = 0.0) -> tuple[int, dict[int, float]]:
    """Return the smallest s modelled within ``margin`` of the least time per inner step, and each candidate's time.

    ``compute_s`` maps each candidate s to its measured local work per exchange.
    With ``margin=0`` this is the argmin (ties: the smaller s).
    """
    if not compute_s:
        raise ValueError("no candidate s to choose from; give compute_s as {s: seconds per exchange}")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin!r} must be in [0, 1): the fraction a larger s must gain to be chosen")
    per_step = {s: casgd_step_seconds(m, p, b, s, c, itemsize) for s, c in sorted(compute_s.items())}
    least = min(per_step.values())
    best = min(s for s, t in per_step.items() if t <= least * (1.0 + margin))
    return best, per_step


def fit_link(samples: list[tuple[int, float, float]]) -> LinkModel:
    """Fit both link shapes to all-reduce samples on one machine set and return the one that fits better.

    A tbf-shaped link (the lab: T = max(L, V·β)) and a plain one (T = L + V·β) are
    both fitted (no core-sharing terms: the samples are taken on the ranks that will
    run, so sharing is already in them); the smaller relative RMS error wins, the
    plain link on a tie. Raises ValueError when neither shape determines a bandwidth.
    """
    fitted = []
    for bucket in (False, True):
        try:
            model = fit(samples, token_bucket=bucket)
        except ValueError:
            continue
        fitted.append((_rms_error(model, samples), bucket, model))
    if not fitted:
        raise ValueError("the samples do not determine a bandwidth; include messages of a few hundred KB")
    return min(fitted, key=lambda item: item[:2])[2]


def _load_glm(paths: list[str]) -> list[dict[str, Any]]:
    """Return the headline rows of ``bench glm --json`` files that carry the compute-alone time."""
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


def glm_seconds(m: LinkModel, row: dict[str, Any], nodes: int | None = None,
                compute_s: float | None = None) -> float:
    """Return the modelled training-loop time of a ``_load_glm`` row (at ``nodes``, with ``compute_s``)."""
    p = row["nodes"] if nodes is None else nodes
    work = row["compute_s"] if compute_s is None else compute_s
    latency, transfer = _loop_terms(m, row, p)
    busy = work * m.compute_factor(p) + latency
    return max(busy, transfer) if m.token_bucket else busy + transfer


def _loop_terms(m: LinkModel, row: dict[str, Any], p: int) -> tuple[float, float]:
    """Return a loop's all-reduce latency and transfer time, over all its exchanges, on ``p`` nodes.

    On a token bucket the timed loop starts on an idle link with its bucket full: the
    first ``burst_bytes`` pass at memory speed, so the transfer is (k·V - burst)·β.
    """
    k = row["exchanges"]
    latency, transfer = (k * t for t in _round_terms(m, row["bytes"], p))
    volume = k * sum(_rounds(row["bytes"], p))
    if m.token_bucket and volume > 0:
        transfer *= max(0.0, volume - m.burst_bytes) / volume
    return latency, transfer


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
    lat, xfer = np.array([_loop_terms(m, r, r["nodes"]) for r in rows]).T
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
    coef = _nonneg_lstsq(np.stack([1 / ts, 1 / (ps * ts)], axis=1))  # relative error: a/t + b/(P t) = 1
    return float(coef[0] + coef[1] / nodes)


def _nonneg_lstsq(a: np.ndarray) -> np.ndarray:
    """Solve min |a·x - 1| with x >= 0 (drop the negative terms and refit)."""
    x = np.zeros(a.shape[1])
    active = [i for i in range(a.shape[1]) if np.any(a[:, i] > 0)]
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], np.ones(a.shape[0]), rcond=None)
        if np.all(sol >= 0):
            x[active] = sol
            break
        active = [i for i, v in zip(active, sol) if v >= 0]
    return x


def _fit_fixed(samples: list[tuple[int, list[float], float]], proto: LinkModel) -> LinkModel | None:
    """Fit α, α_large, β with the sharing exponents of ``proto`` fixed.

    Linear in the three coefficients, except that a token bucket takes the larger of
    latency and transfer: each sample is assigned to the term that dominates it,
    both sides fitted, and the assignment repeated until it settles. ``samples`` are
    (nodes, message bytes of each round, seconds).
    """
    terms = []
    for p, msgs, t in samples:
        r1, r2, _ = _counts(msgs)
        ls = proto.crowding(p) ** proto.latency_share
        v = sum(b * proto.byte_s(p, b) for b in msgs)  # proto.beta = 1: bytes, weighted by sharing
        terms.append((np.array([r1 * ls / t, r2 * ls / t]), v / t))
    side: list[str | None] = [None] * len(terms)  # None: both terms add (no bucket)
    if proto.token_bucket:  # start: the half with the most bytes per round is bandwidth-bound
        per_round = [b / max(lat.sum(), 1e-300) for lat, b in terms]
        cut = float(np.median(per_round))
        side = ["bytes" if r > cut else "latency" for r in per_round]
    for _ in range(30):
        if proto.token_bucket:
            lat_rows = [lat for (lat, _), s in zip(terms, side) if s == "latency"]
            byte_rows = [[b] for (_, b), s in zip(terms, side) if s == "bytes"]
            alphas = _nonneg_lstsq(np.array(lat_rows)) if lat_rows else np.zeros(2)
            beta = float(_nonneg_lstsq(np.array(byte_rows))[0]) if byte_rows else 0.0
        else:
            coef = _nonneg_lstsq(np.array([[*lat, b] for lat, b in terms]))
            alphas, beta = coef[:2], float(coef[2])
        if beta <= 0:
            return None
        if not proto.token_bucket:
            break
        new = ["latency" if float(lat @ alphas) >= b * beta else "bytes" for lat, b in terms]
        if new == side:
            break
        side = new
    a1, a2 = float(alphas[0]), float(alphas[1])
    if a1 == 0.0 and a2 > 0:
        a1 = a2  # no inline round in the samples: assume the same latency
    return dataclasses.replace(proto, alpha=a1, alpha_large=a2 if a2 > 0 else None, beta=beta)


def _rms_error(m: LinkModel, samples: list[tuple[int, float, float]]) -> float:
    return float(np.sqrt(np.mean([(allreduce_seconds(m, n, p) / t - 1) ** 2 for p, n, t in samples])))


def fit(samples: list[tuple[int, float, float]], cores: int | None = None,
        token_bucket: bool = False) -> LinkModel:
    """Fit the model to (nodes, bytes, seconds) samples, minimising relative error.

    With ``cores`` (the cores the measured ranks shared), the sharing exponents are
    searched too when the samples include node counts above it. ``token_bucket``:
    the samples come from the lab's tbf-shaped links.
    """
    samples = [(p, n, t) for p, n, t in samples if p > 1 and t > 0]
    if len(samples) < 2:
        raise ValueError(f"need at least 2 samples on more than one node to fit, got {len(samples)}")
    shared = cores is not None and any(p > cores for p, _, _ in samples)
    grid_a = np.round(np.arange(0.0, 2.001, 0.05), 2) if shared else [0.0]
    grid_b = np.round(np.arange(0.0, 1.001, 0.05), 2) if shared else [0.0]
    rounds = [(p, _rounds(n, p), t) for p, n, t in samples]  # the same for every grid point
    best: tuple[float, LinkModel] | None = None
    for ka in grid_a:
        for kb in grid_b:
            proto = LinkModel(alpha=0.0, beta=1.0, cores=cores, latency_share=float(ka),
                              bandwidth_share=float(kb), token_bucket=token_bucket)
            m = _fit_fixed(rounds, proto)
            if m is not None:
                err = _rms_error(m, samples)
                if best is None or err < best[0] - 1e-12:
                    best = (err, m)
    if best is None:
        raise ValueError("the samples do not determine a bandwidth; include messages of a few MB")
    return best[1]


def _load(paths: list[str]) -> list[tuple[int, float, float]]:
    """Return the FP32 all-reduce samples (nodes, bytes, seconds) of ``bench allreduce --json`` files."""
    samples = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            rows = json.load(fh)
        samples += [(int(r["ranks"]), float(r["bytes"]), float(r["raw_us"]) * 1e-6) for r in rows
                    if not r.get("codec")]
    return samples


def _load_codec(paths: list[str]) -> list[dict[str, Any]]:
    """Return the compressed rows (``bench allreduce --codec ... --json``): nodes, bytes, codec, both times."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            out += [{"nodes": int(r["ranks"]), "bytes": float(r["bytes"]), "codec": r["codec"],
                     "fp32_s": float(r["raw_us"]) * 1e-6, "codec_s": float(r["commwire_us"]) * 1e-6,
                     "segment": r.get("segment_bytes")}
                    for r in json.load(fh) if r.get("codec")]
    return out


def validate_codec(m: LinkModel, rows: list[dict[str, Any]],
                   rates: dict[str, tuple[float, float, float]]) -> list[dict[str, Any]]:
    """Return measured vs predicted compressed all-reduce time and speedup over FP32 for each row.

    The prediction is for the segment the row ran with (the tuner's choice, when the
    row records it): the model's own choice is for projections, the check is of the
    time of what ran. ``rates`` maps a codec spec to (encode B/s, decode B/s, wire ratio), as ``_codec_rates`` measures.
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
    from ..lab.bandwidth import parse_bandwidth, tbf_burst
    from .allreduce import parse_size

    parser = argparse.ArgumentParser(prog="commwire bench project", description=__doc__,
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
        model = fit(samples, cores=args.cores or None, token_bucket=args.shaper == "tbf")
        if model.token_bucket:
            model = dataclasses.replace(model, burst_bytes=float(tbf_burst(parse_bandwidth(args.lab_bandwidth))))
        large = model.alpha if model.alpha_large is None else model.alpha_large
        print(f"fitted on {len(samples)} samples of {', '.join(args.calibrate)}: α = {model.alpha * 1e6:.1f} µs "
              f"(≤ {INJECT_BYTES} B), α_large = {large * 1e6:.1f} µs, β = {model.beta * 1e9:.3f} ns/B "
              f"({8 / model.beta / 1e9:.2f} Gbit/s); core sharing ({model.cores or 'none'} cores): "
              f"latency × g^{model.latency_share:.2f}, β × g^{model.bandwidth_share:.2f}, g = P/cores; "
              f"links {'tbf-shaped: max(latency, transfer), bucket %.0f B' % model.burst_bytes if model.token_bucket else 'latency + transfer'}")
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
    codec_rows = _load_codec(args.validate) if args.validate else []
    if codec_rows and model is not None:
        specs_seen = sorted({r["codec"] for r in codec_rows})
        measured_rates = {spec: _codec_rates(spec) for spec in specs_seen}
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
    glm_rows = _load_glm(args.glm) if args.glm else []
    if glm_rows:
        if model is None:
            raise SystemExit("--glm needs --calibrate files to fit the link model first")
        present = sorted({r["nodes"] for r in glm_rows})
        fit_nodes = ({int(v) for v in args.glm_fit_nodes.split(",") if v.strip()} if args.glm_fit_nodes
                     else set(present[:-1]) or set(present))
        solvers = {r["solver"] for r in glm_rows}
        fit_solvers = {v for v in args.glm_fit_solvers.split(",") if v.strip()} if args.glm_fit_solvers else solvers
        if not fit_solvers <= solvers:
            raise SystemExit(f"--glm-fit-solvers {args.glm_fit_solvers}: the --glm rows have solvers "
                             f"{sorted(solvers)}")
        fitted = {(p, s) for p in fit_nodes for s in fit_solvers}
        model = fit_compute(model, [r for r in glm_rows if (r["nodes"], r["solver"]) in fitted])
        _print_glm(model, glm_rows, fitted)
    if model is not None:
        model = model.alone()  # a cluster: one rank per node
    alpha = _parse_latency(args.latency) if args.latency else (model.alpha if model else None)
    beta = 8 / parse_bandwidth(args.bandwidth) if args.bandwidth else (model.beta if model else None)
    if alpha is None or beta is None:
        if not args.validate:
            raise SystemExit("give --calibrate files, or both --bandwidth and --latency, to project")
        return 0
    large = alpha if args.latency or model is None else model.alpha_large
    link = LinkModel(alpha=alpha, alpha_large=large, beta=beta)
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
    if glm_rows:
        _project_glm(link, glm_rows, [int(v) for v in args.nodes.split(",")])
    return 0


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
        for label, fit in (("fitted", True), ("held-out", False)):
            errs = [abs(r["error"]) for r in checked if r["nodes"] == p and r["fit"] == fit]
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


if __name__ == "__main__":
    raise SystemExit(main())
