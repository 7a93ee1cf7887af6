"""Latency–bandwidth (α–β) cost model of commwire's all-reduces, and its fit to measured times.

Model of one FP32 all-reduce of n bytes on P nodes, following MPICH's own
algorithm choice (its coll_selection.json): recursive doubling when the message
is at most 8 bytes or has fewer elements than the largest power of two ≤ P
(log2 P rounds of the whole message), otherwise reduce-scatter + all-gather
(rounds of n/2, n/4, …, n/P and back; 2(P−1)/P · n bytes sent per rank).
A non-power-of-two P adds two rounds of the whole message (``rounds``). Each
round costs

    α        for a message of at most ``INJECT_BYTES`` (libfabric's tcp provider
             sends it inline, with no completion to wait for),
    α_large  for a longer one,

and the bytes cost β each. On a real link the two add up: T = L + V·β. A
token-bucket shaper (tbf, as ``commwire lab`` builds) lets a message through at
memory speed while it holds tokens, so a loop of small all-reduces never waits
for bandwidth and a large one always does: there T = max(L, V·β).

When P ranks share ``cores`` cores (every emulated host of the lab runs on one
machine) each rank waits for g = P/cores ranks per core to be scheduled, and the
kernel's TCP work competes for the same cores, so

    L → L · g^κ_α,   β → β · g^κ_β   (g = max(1, P/cores)),

the latter only for messages above ``SAVED_BYTES``: libfabric's tcp provider
takes in smaller ones even before their receive is posted, while a longer one
waits for its receiver to be scheduled. ``LinkModel.alone`` drops g and the
token bucket: one rank per node on real links, what a cluster has.

The compressed all-reduce (wire ratio w, codec throughputs from ``codec_rates``)
is pipelined:

    T_codec(n, P) = max(wire, cpu)·(s−1)/s + (wire + cpu)/s   (s pipeline segments),
    wire = s·2(P−1)·α(message)·g^κ_α + 2(P−1)/P · w·n·β·g^κ_β,
    cpu  = (n/enc + n(2−1/P)/dec) · g,

with the segment chosen, as the all-reduce's tuner does, as the fastest of
``PEER_CHOICES``.

A training loop exchanges after each compute step (``step_seconds``): the
compute (stretched by ``LinkModel.compute_factor`` on shared cores) sits on the
critical path with the all-reduce's latency.

CA-SGD's s (``GLM(s="auto")``, :mod:`commwire.glm`): at fit time the solver
all-reduces each candidate's payload a few times on its own ranks, fits α,
α_large, β with ``fit_link`` (whichever of the tbf and plain shapes fits better),
times each candidate's local work per exchange c_s and takes the s of least
time per inner step (``choose_s``):

    T(s) = step_seconds(sstep_words(s, b)·itemsize, c_s) / s,   sstep_words(s, b) = s·b + s(s−1)/2 · b².

``fit`` fits α, α_large, β (and, with ``cores``, κ_α and κ_β by a grid search)
by least squares on relative error to (nodes, bytes, seconds) samples.
``commwire bench project`` projects a link to many nodes with this model.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from .codecs.collective import PEER_CHOICES, segment_bytes_at  # the all-reduce's own segment rule

__all__ = ["INJECT_BYTES", "SAVED_BYTES", "SHORT_BYTES", "LinkModel", "rounds", "round_terms",
           "allreduce_seconds", "segment_bytes", "compressed_seconds", "step_seconds", "sstep_words",
           "casgd_step_seconds", "choose_s", "fit", "fit_link", "nonneg_lstsq", "codec_rates"]


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
    """Per-round latencies α (s), per-byte time β (s/B), core sharing and a token-bucket shaper.

    ``alpha`` is a round with an inline message (≤ ``INJECT_BYTES``), ``alpha_large``
    one with a longer message (None: the same as ``alpha``). With ``cores`` (the
    cores P ranks share), latencies scale by g^latency_share and β by
    g^bandwidth_share, g = max(1, P/cores), and a training loop's compute by
    compute_scale · g^compute_share (see ``step_seconds``). ``token_bucket``: the
    link is a tbf shaper (the lab), so latency and transfer overlap, T = max(L, V·β),
    and ``burst_bytes`` is its bucket: a loop that starts on an idle link sends that
    many bytes at memory speed first.
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


def rounds(nbytes: float, p: int) -> list[float]:
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


def _combine(m: LinkModel, latency: float, transfer: float) -> float:
    return max(latency, transfer) if m.token_bucket else latency + transfer


def round_terms(m: LinkModel, nbytes: float, p: int) -> tuple[float, float]:
    """Return the latency and the transfer time of MPICH's all-reduce of ``nbytes`` on ``p`` nodes."""
    msgs = rounds(nbytes, p)
    return sum(m.round_s(p, b) for b in msgs), sum(b * m.byte_s(p, b) for b in msgs)


def allreduce_seconds(m: LinkModel, nbytes: float, p: int) -> float:
    """Return the modelled FP32 all-reduce time of ``nbytes`` on ``p`` nodes."""
    return _combine(m, *round_terms(m, nbytes, p))


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
    ``segment`` (FP32 bytes, as ``commwire bench allreduce`` reports the tuner's choice) too.
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
    all-reduce's latency; on a token bucket the link refills while ranks compute, so
    the step is max(compute + latency, transfer), on a real link their sum.
    """
    latency, transfer = round_terms(m, nbytes, p)
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


def nonneg_lstsq(a: np.ndarray) -> np.ndarray:
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
        inline = sum(m <= INJECT_BYTES for m in msgs)
        ls = proto.crowding(p) ** proto.latency_share
        v = sum(b * proto.byte_s(p, b) for b in msgs)  # proto.beta = 1: bytes, weighted by sharing
        terms.append((np.array([inline * ls / t, (len(msgs) - inline) * ls / t]), v / t))
    side: list[str | None] = [None] * len(terms)  # None: both terms add (no bucket)
    if proto.token_bucket:  # start: the half with the most bytes per round is bandwidth-bound
        per_round = [b / max(lat.sum(), 1e-300) for lat, b in terms]
        cut = float(np.median(per_round))
        side = ["bytes" if r > cut else "latency" for r in per_round]
    for _ in range(30):
        if proto.token_bucket:
            lat_rows = [lat for (lat, _), s in zip(terms, side) if s == "latency"]
            byte_rows = [[b] for (_, b), s in zip(terms, side) if s == "bytes"]
            alphas = nonneg_lstsq(np.array(lat_rows)) if lat_rows else np.zeros(2)
            beta = float(nonneg_lstsq(np.array(byte_rows))[0]) if byte_rows else 0.0
        else:
            coef = nonneg_lstsq(np.array([[*lat, b] for lat, b in terms]))
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
    the samples come from tbf-shaped links.
    """
    samples = [(p, n, t) for p, n, t in samples if p > 1 and t > 0]
    if len(samples) < 2:
        raise ValueError(f"need at least 2 samples on more than one node to fit, got {len(samples)}")
    shared = cores is not None and any(p > cores for p, _, _ in samples)
    grid_a = np.round(np.arange(0.0, 2.001, 0.05), 2) if shared else [0.0]
    grid_b = np.round(np.arange(0.0, 1.001, 0.05), 2) if shared else [0.0]
    msgs = [(p, rounds(n, p), t) for p, n, t in samples]  # the same for every grid point
    best: tuple[float, LinkModel] | None = None
    for ka in grid_a:
        for kb in grid_b:
            proto = LinkModel(alpha=0.0, beta=1.0, cores=cores, latency_share=float(ka),
                              bandwidth_share=float(kb), token_bucket=token_bucket)
            m = _fit_fixed(msgs, proto)
            if m is not None:
                err = _rms_error(m, samples)
                if best is None or err < best[0] - 1e-12:
                    best = (err, m)
    if best is None:
        raise ValueError("the samples do not determine a bandwidth; include messages of a few MB")
    return best[1]


def fit_link(samples: list[tuple[int, float, float]]) -> LinkModel:
    """Fit both link shapes to all-reduce samples on one machine set and return the one that fits better.

    A tbf-shaped link (T = max(L, V·β)) and a plain one (T = L + V·β) are both
    fitted (no core-sharing terms: the samples are taken on the ranks that will
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


def codec_rates(spec: str, nbytes: int = 16 << 20) -> tuple[float, float, float]:
    """Measure this machine's encode and decode throughput (B/s of FP32) and the wire ratio of codec ``spec``."""
    from .codecs import get

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
