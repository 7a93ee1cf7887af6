"""The α–β cost model of commwire.costmodel — tier 1 (single process; synthetic samples with known parameters).

The choice of s="auto" (commwire.glm) rests on ``choose_s``; the calibration against
measured times is a research study (benchmarks/calibrate.py, tests/core/test_calibrate.py).
"""

import math

import pytest

from commwire import costmodel as cm


def test_fit_recovers_alpha_and_beta_from_two_nodes():
    truth = cm.LinkModel(alpha=20e-6, alpha_large=45e-6, beta=8e-9)
    samples = [(p, n, cm.allreduce_seconds(truth, n, p)) for p in (2, 4, 8) for n in (16, 4096, 1 << 20, 1 << 24)]
    fitted = cm.fit(samples[:4])  # two nodes only
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fitted.alpha_large == pytest.approx(truth.alpha_large, rel=1e-6)
    assert fitted.beta == pytest.approx(truth.beta, rel=1e-6)
    assert [cm.allreduce_seconds(fitted, n, p) for p, n, _ in samples] == pytest.approx([t for *_, t in samples])


def _terms(nbytes, p):
    """Return (inline rounds, longer rounds, bytes each rank sends) of the all-reduce, from its rounds."""
    msgs = cm.rounds(nbytes, p)
    inline = sum(m <= cm.INJECT_BYTES for m in msgs)
    return inline, len(msgs) - inline, float(sum(msgs))


def test_rounds_follow_mpich_algorithm_choice():
    # recursive doubling up to 8 bytes, or when there are fewer elements than the power of two
    assert cm.rounds(8, 4) == [8.0, 8.0]
    assert _terms(16, 8) == (3, 0, 48.0)  # 4 floats < 8 ranks
    # reduce-scatter + all-gather otherwise: n/2, n/4, ... and back; 2(P-1)/P of n in all
    assert cm.rounds(16, 4) == [8.0, 4.0, 4.0, 8.0]
    n = 1 << 20
    inline, longer, volume = _terms(n, 8)
    assert (inline, longer) == (0, 6) and volume == pytest.approx(2 * 7 / 8 * n)
    # a non-power-of-two count adds a round of the whole message at each end
    assert cm.rounds(n, 6) == [n, n / 2, n / 4, n / 4, n / 2, n]
    # messages up to INJECT_BYTES cost alpha, longer ones alpha_large
    m = cm.LinkModel(alpha=1e-6, alpha_large=3e-6, beta=1e-9)
    assert m.round_s(2, cm.INJECT_BYTES) == 1e-6 and m.round_s(2, cm.INJECT_BYTES + 1) == 3e-6


def test_compressed_model_approaches_the_byte_ratio_when_codecs_are_free():
    link = cm.LinkModel(alpha=0.0, beta=8e-9)
    n = 64 << 20
    fp32 = cm.allreduce_seconds(link, n, 8)
    fp8 = cm.compressed_seconds(link, n, 8, wire_ratio=0.25, enc_Bps=1e18, dec_Bps=1e18, peer_bytes=32 << 10)
    segments = math.ceil(n / cm.segment_bytes(8, 0.25, 32 << 10))
    assert fp32 / fp8 == pytest.approx(4.0, rel=1e-6)  # free codecs: the byte ratio
    # codec work hides behind the wire until it is the longer of the two; then the wire
    # shows only in the one segment that fills the pipeline
    slow = cm.compressed_seconds(link, n, 8, wire_ratio=0.25, enc_Bps=1e8, dec_Bps=1e8, peer_bytes=32 << 10)
    cpu = n / 1e8 + n * (2 - 1 / 8) / 1e8
    assert slow == pytest.approx(cpu + fp8 / segments, rel=1e-6)
    # one segment: nothing overlaps
    small = 1 << 20
    one = cm.compressed_seconds(link, small, 8, wire_ratio=0.25, enc_Bps=1e8, dec_Bps=1e8, peer_bytes=32 << 10)
    wire = cm.compressed_seconds(link, small, 8, wire_ratio=0.25, enc_Bps=1e18, dec_Bps=1e18,
                                 peer_bytes=32 << 10)
    # left to choose, the model takes the fastest segment of the tuner's candidates
    assert slow >= cm.compressed_seconds(link, n, 8, wire_ratio=0.25, enc_Bps=1e8, dec_Bps=1e8)
    assert one == pytest.approx(wire + small / 1e8 + small * (2 - 1 / 8) / 1e8, rel=1e-6)


def test_core_sharing_and_token_bucket_are_recovered_and_dropped_for_a_cluster():
    truth = cm.LinkModel(alpha=12e-6, alpha_large=25e-6, beta=8.5e-9, cores=2, latency_share=1.1,
                         bandwidth_share=0.2, token_bucket=True)
    assert truth.crowding(2) == 1.0 and truth.crowding(8) == 4.0
    sizes = (16, 256, 1024, 4096, 1 << 16, 1 << 20, 1 << 24)
    samples = [(p, n, cm.allreduce_seconds(truth, n, p)) for p in (2, 4) for n in sizes]
    fitted = cm.fit(samples, cores=2, token_bucket=True)
    for name in ("alpha", "alpha_large", "beta", "latency_share", "bandwidth_share"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    # predicts a node count it never saw
    for n in sizes:
        assert cm.allreduce_seconds(fitted, n, 8) == pytest.approx(cm.allreduce_seconds(truth, n, 8))
    # the bucket overlaps latency and transfer; a real link adds them
    n = 1 << 14
    lat = sum(truth.round_s(4, b) for b in cm.rounds(n, 4))
    xfer = _terms(n, 4)[2] * truth.beta  # messages of 8 KiB at most: no sharing penalty
    assert cm.allreduce_seconds(truth, n, 4) == pytest.approx(max(lat, xfer))
    # core sharing slows only messages above SAVED_BYTES
    assert truth.byte_s(8, cm.SAVED_BYTES) == truth.beta
    assert truth.byte_s(8, cm.SAVED_BYTES + 1) == pytest.approx(truth.beta * 4**0.2)
    alone = fitted.alone()
    assert alone.crowding(1024) == 1.0 and not alone.token_bucket and alone.alpha == fitted.alpha
    assert cm.allreduce_seconds(alone, n, 2) == pytest.approx(
        sum(alone.round_s(2, b) for b in cm.rounds(n, 2)) + _terms(n, 2)[2] * alone.beta)
    # without the cores the sharing exponents cannot be fitted and stay 0
    assert cm.fit(samples, token_bucket=True).latency_share == 0.0


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least 2 samples"):
        cm.fit([(2, 16, 1e-5)])
    with pytest.raises(ValueError, match="beta"):
        cm.LinkModel(alpha=1e-6, beta=0.0)
    with pytest.raises(ValueError, match="latency_share"):
        cm.LinkModel(alpha=1e-6, beta=1e-9, latency_share=-1.0)
    with pytest.raises(ValueError, match="cores=0"):
        cm.LinkModel(alpha=1e-6, beta=1e-9, cores=0)


def test_step_model_overlaps_compute_with_the_bucket_and_adds_it_on_a_real_link():
    lab = cm.LinkModel(alpha=20e-6, alpha_large=40e-6, beta=8e-9, cores=2, latency_share=1.0,
                       token_bucket=True, compute_scale=1.5, compute_share=2.0)
    n, work = 32256.0, 100e-6
    lat = sum(lab.round_s(8, b) for b in cm.rounds(n, 8))
    xfer = sum(b * lab.byte_s(8, b) for b in cm.rounds(n, 8))
    assert lab.compute_factor(8) == pytest.approx(1.5 * 4.0**2)
    assert cm.step_seconds(lab, n, 8, work) == pytest.approx(max(work * 24 + lat, xfer))
    lat2 = sum(lab.round_s(2, b) for b in cm.rounds(n, 2))
    assert cm.step_seconds(lab, n, 2, work) == pytest.approx(max(work * 1.5 + lat2, xfer * 2 / 3.5))
    cluster = lab.alone()  # one rank per node: compute as measured alone, latency and transfer add up
    assert cluster.compute_factor(1024) == 1.0
    assert cm.step_seconds(cluster, n, 2, work) == pytest.approx(
        work + sum(cluster.round_s(2, b) + b * cluster.beta for b in cm.rounds(n, 2)))
    with pytest.raises(ValueError, match="compute_scale=0"):
        cm.LinkModel(alpha=1e-6, beta=1e-9, compute_scale=0.0)


def _casgd_step_by_hand(alpha, alpha_large, beta, bucket, p, b, s, compute):
    """Per-step CA-SGD time written out for p = 2 or 4 (MPICH's rounds), independent of the model's helpers."""
    words = s * b + s * (s - 1) // 2 * b * b
    n = words * 4
    if p == 2:
        msgs = [n] if n <= 8 or words < 2 else [n / 2, n / 2]
    else:
        assert p == 4
        msgs = [n, n] if n <= 8 or words < 4 else [n / 2, n / 4, n / 4, n / 2]
    latency = sum(alpha if msg <= 128 else alpha_large for msg in msgs)
    transfer = beta * sum(msgs)
    exchange = max(compute + latency, transfer) if bucket else compute + latency + transfer
    return exchange / s


@pytest.mark.parametrize("bucket", [False, True])
@pytest.mark.parametrize("p, b, alpha, alpha_large, beta, gram_ns, expected", [
    (4, 4, 80e-6, 100e-6, 8e-9, 2.0, (32, 32)),  # lab-like 1 Gbit/s, small batch: latency amortised up to s=32
    (4, 16, 80e-6, 100e-6, 8e-9, 2.0, (8, 8)),   # the (s b)^2 Gram payload takes over sooner at b=16
    (2, 4, 1e-6, 1e-6, 1e-11, 200.0, (1, 1)),    # free messages, costly Gram: plain SGD
    (4, 64, 30e-6, 30e-6, 1e-9, 1.0, (2, 4)),    # big batches; a token bucket hides the transfer behind the Gram
])
def test_choose_s_is_the_argmin_of_an_independent_cost(bucket, p, b, alpha, alpha_large, beta, gram_ns, expected):
    link = cm.LinkModel(alpha=alpha, alpha_large=alpha_large, beta=beta, token_bucket=bucket)
    cands = (1, 2, 4, 8, 16, 32, 64)
    # local work per exchange: a fixed loop cost plus a Gram of (1 + s b)^2 entries over 128 columns
    compute = {s: 10e-6 + gram_ns * 1e-9 * (1 + s * b) ** 2 * 128 / 64 for s in cands}
    best, per_step = cm.choose_s(link, p, b, compute)
    by_hand = {s: _casgd_step_by_hand(alpha, alpha_large, beta, bucket, p, b, s, c) for s, c in compute.items()}
    assert per_step == pytest.approx(by_hand, rel=1e-12)
    assert best == min(by_hand, key=by_hand.get) == expected[bucket]
    assert cm.casgd_step_seconds(link, p, b, best, compute[best]) == pytest.approx(by_hand[best])


def test_choose_s_breaks_ties_towards_the_smaller_s_and_skips_unmeasured():
    link = cm.LinkModel(alpha=0.0, beta=1.0)  # one rank: no messages
    best, per_step = cm.choose_s(link, 1, 8, {1: 2e-6, 2: 4e-6, 4: math.inf})
    assert best == 1 and per_step[4] == math.inf
    with pytest.raises(ValueError, match="no candidate s"):
        cm.choose_s(link, 1, 8, {})
    assert cm.sstep_words(32, 4) == 32 * 4 + 496 * 16


def test_choose_s_with_a_margin_takes_the_smallest_s_near_the_best():
    link = cm.LinkModel(alpha=0.0, beta=1.0)  # one rank: the modelled step is the work over s
    compute = {8: 8 * 12e-6, 16: 16 * 10.5e-6, 32: 32 * 10e-6, 64: 64 * 9.8e-6}
    assert cm.choose_s(link, 1, 4, compute)[0] == 64  # the argmin
    assert cm.choose_s(link, 1, 4, compute, margin=0.1)[0] == 16  # 10.5 within 10% of 9.8; 12 is not
    assert cm.choose_s(link, 1, 4, compute, margin=0.25)[0] == 8
    with pytest.raises(ValueError, match=r"margin=1.5 must be in \[0, 1\)"):
        cm.choose_s(link, 1, 4, compute, margin=1.5)


@pytest.mark.parametrize("bucket", [False, True])
def test_fit_link_recovers_the_shape_of_the_link(bucket):
    truth = cm.LinkModel(alpha=60e-6, alpha_large=90e-6, beta=8e-9, token_bucket=bucket)
    sizes = [16, 96, 448, 1920, 7936, 32256, 130048]
    samples = [(4, float(n), cm.allreduce_seconds(truth, n, 4)) for n in sizes]
    fitted = cm.fit_link(samples)
    assert fitted.token_bucket == bucket
    assert (fitted.alpha, fitted.alpha_large, fitted.beta) == pytest.approx((60e-6, 90e-6, 8e-9), rel=1e-6)
    with pytest.raises(ValueError, match="determine a bandwidth"):
        cm.fit_link([(4, 16.0, 1e-4)])


def test_codec_rates_measure_both_directions_and_the_wire_ratio():
    enc, dec, ratio = cm.codec_rates("fp8-e4m3", nbytes=1 << 16)
    assert enc > 0 and dec > 0 and 0.25 <= ratio < 0.3  # one byte per float32 and the scales
