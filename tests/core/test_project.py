"""The α–β cost model — tier 1 (single process; synthetic samples with known parameters)."""

import dataclasses
import json
import math

import pytest

from commwire.bench import project


def test_fit_recovers_alpha_and_beta_and_validates_exactly(tmp_path):
    truth = project.LinkModel(alpha=20e-6, alpha_large=45e-6, beta=8e-9)
    samples = [(p, n, project.allreduce_seconds(truth, n, p)) for p in (2, 4, 8) for n in (16, 4096, 1 << 20, 1 << 24)]
    fitted = project.fit(samples[:4])  # two nodes only
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fitted.alpha_large == pytest.approx(truth.alpha_large, rel=1e-6)
    assert fitted.beta == pytest.approx(truth.beta, rel=1e-6)
    assert max(abs(r["error"]) for r in project.validate(fitted, samples)) < 1e-6
    path = tmp_path / "cal.json"
    path.write_text(json.dumps([{"ranks": p, "bytes": n, "raw_us": t * 1e6} for p, n, t in samples]))
    loaded = project._load([str(path)])
    assert [(p, n) for p, n, _ in loaded] == [(p, n) for p, n, _ in samples]
    assert [t for *_, t in loaded] == pytest.approx([t for *_, t in samples])


def test_rounds_follow_mpich_algorithm_choice():
    # recursive doubling up to 8 bytes, or when there are fewer elements than the power of two
    assert project._rounds(8, 4) == [8.0, 8.0]
    assert project._terms(16, 8) == (3, 0, 48.0)  # 4 floats < 8 ranks
    # reduce-scatter + all-gather otherwise: n/2, n/4, ... and back; 2(P-1)/P of n in all
    assert project._rounds(16, 4) == [8.0, 4.0, 4.0, 8.0]
    n = 1 << 20
    inline, longer, volume = project._terms(n, 8)
    assert (inline, longer) == (0, 6) and volume == pytest.approx(2 * 7 / 8 * n)
    # a non-power-of-two count adds a round of the whole message at each end
    assert project._rounds(n, 6) == [n, n / 2, n / 4, n / 4, n / 2, n]
    # messages up to INJECT_BYTES cost alpha, longer ones alpha_large
    m = project.LinkModel(alpha=1e-6, alpha_large=3e-6, beta=1e-9)
    assert m.round_s(2, project.INJECT_BYTES) == 1e-6 and m.round_s(2, project.INJECT_BYTES + 1) == 3e-6


def test_compressed_model_approaches_the_byte_ratio_when_codecs_are_free():
    link = project.LinkModel(alpha=0.0, beta=8e-9)
    n = 64 << 20
    fp32 = project.allreduce_seconds(link, n, 8)
    fp8 = project.compressed_seconds(link, n, 8, wire_ratio=0.25, enc_Bps=1e18, dec_Bps=1e18, peer_bytes=32 << 10)
    segments = math.ceil(n / project.segment_bytes(8, 0.25, 32 << 10))
    assert fp32 / fp8 == pytest.approx(4.0, rel=1e-6)  # free codecs: the byte ratio
    # codec work hides behind the wire until it is the longer of the two; then the wire
    # shows only in the one segment that fills the pipeline
    slow = project.compressed_seconds(link, n, 8, wire_ratio=0.25, enc_Bps=1e8, dec_Bps=1e8, peer_bytes=32 << 10)
    cpu = n / 1e8 + n * (2 - 1 / 8) / 1e8
    assert slow == pytest.approx(cpu + fp8 / segments, rel=1e-6)
    # one segment: nothing overlaps
    small = 1 << 20
    one = project.compressed_seconds(link, small, 8, wire_ratio=0.25, enc_Bps=1e8, dec_Bps=1e8, peer_bytes=32 << 10)
    wire = project.compressed_seconds(link, small, 8, wire_ratio=0.25, enc_Bps=1e18, dec_Bps=1e18,
                                      peer_bytes=32 << 10)
    # left to choose, the model takes the fastest segment of the tuner's candidates
    assert slow >= project.compressed_seconds(link, n, 8, wire_ratio=0.25, enc_Bps=1e8, dec_Bps=1e8)
    assert one == pytest.approx(wire + small / 1e8 + small * (2 - 1 / 8) / 1e8, rel=1e-6)


def test_core_sharing_and_token_bucket_are_recovered_and_dropped_for_a_cluster():
    truth = project.LinkModel(alpha=12e-6, alpha_large=25e-6, beta=8.5e-9, cores=2, latency_share=1.1,
                              bandwidth_share=0.2, token_bucket=True)
    assert truth.crowding(2) == 1.0 and truth.crowding(8) == 4.0
    sizes = (16, 256, 1024, 4096, 1 << 16, 1 << 20, 1 << 24)
    samples = [(p, n, project.allreduce_seconds(truth, n, p)) for p in (2, 4) for n in sizes]
    fitted = project.fit(samples, cores=2, token_bucket=True)
    for name in ("alpha", "alpha_large", "beta", "latency_share", "bandwidth_share"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    # predicts a node count it never saw
    for n in sizes:
        assert project.allreduce_seconds(fitted, n, 8) == pytest.approx(project.allreduce_seconds(truth, n, 8))
    # the bucket overlaps latency and transfer; a real link adds them
    n = 1 << 14
    lat = sum(truth.round_s(4, b) for b in project._rounds(n, 4))
    xfer = project._terms(n, 4)[2] * truth.beta  # messages of 8 KiB at most: no sharing penalty
    assert project.allreduce_seconds(truth, n, 4) == pytest.approx(max(lat, xfer))
    # core sharing slows only messages above SAVED_BYTES
    assert truth.byte_s(8, project.SAVED_BYTES) == truth.beta
    assert truth.byte_s(8, project.SAVED_BYTES + 1) == pytest.approx(truth.beta * 4**0.2)
    alone = fitted.alone()
    assert alone.crowding(1024) == 1.0 and not alone.token_bucket and alone.alpha == fitted.alpha
    assert project.allreduce_seconds(alone, n, 2) == pytest.approx(
        sum(alone.round_s(2, b) for b in project._rounds(n, 2)) + project._terms(n, 2)[2] * alone.beta)
    # without the cores the sharing exponents cannot be fitted and stay 0
    assert project.fit(samples, token_bucket=True).latency_share == 0.0


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least 2 samples"):
        project.fit([(2, 16, 1e-5)])
    with pytest.raises(ValueError, match="like 5us"):
        project._parse_latency("fast")
    with pytest.raises(ValueError, match="beta"):
        project.LinkModel(alpha=1e-6, beta=0.0)
    with pytest.raises(ValueError, match="latency_share"):
        project.LinkModel(alpha=1e-6, beta=1e-9, latency_share=-1.0)
    with pytest.raises(ValueError, match="cores=0"):
        project.LinkModel(alpha=1e-6, beta=1e-9, cores=0)


def test_projection_prints_a_row_per_node_count(capsys):
    assert project.main(["--nodes", "2,1024", "--bandwidth", "100gbit", "--latency", "5us", "--size", "4M",
                         "--codecs", "fp8-e4m3"]) == 0
    out = capsys.readouterr().out
    assert "| 2 |" in out and "| 1024 |" in out and "fp8-e4m3 speedup" in out


def test_codec_rows_are_validated_as_times_and_speedups(tmp_path):
    link = project.LinkModel(alpha=20e-6, alpha_large=40e-6, beta=8e-9, cores=2, latency_share=1.0,
                             bandwidth_share=0.2, token_bucket=True)
    rates = {"fp8-e4m3": (2e9, 4e9, 0.25)}
    n = 64 << 20
    t32 = project.allreduce_seconds(link, n, 4)
    t8 = project.compressed_seconds(link, n, 4, wire_ratio=0.25, enc_Bps=2e9, dec_Bps=4e9)
    path = tmp_path / "codec.json"
    path.write_text(json.dumps([{"ranks": 4, "bytes": n, "codec": "fp8-e4m3", "raw_us": t32 * 1e6,
                                 "commwire_us": t8 * 1.25e6}]))
    assert project._load([str(path)]) == []  # compressed rows are not FP32 samples
    (row,) = project.validate_codec(link, project._load_codec([str(path)]), rates)
    assert row["error"] == pytest.approx(1 / 1.25 - 1)
    assert row["predicted_speedup"] == pytest.approx(t32 / t8) and row["speedup"] == pytest.approx(t32 / t8 / 1.25)


def _glm_row(nodes, solver, s, compute_s, wall_s, nbytes, steps=1024, dataset="d"):
    return {"nodes": nodes, "dataset": dataset, "solver": solver, "precision": "fp32", "s": s, "b": 4,
            "steps": steps, "bytes": float(nbytes), "exchanges": math.ceil(steps / s), "wall_s": wall_s,
            "compute_s": compute_s}


def test_step_model_overlaps_compute_with_the_bucket_and_adds_it_on_a_real_link():
    lab = project.LinkModel(alpha=20e-6, alpha_large=40e-6, beta=8e-9, cores=2, latency_share=1.0,
                            token_bucket=True, compute_scale=1.5, compute_share=2.0)
    n, work = 32256.0, 100e-6
    lat = sum(lab.round_s(8, b) for b in project._rounds(n, 8))
    xfer = sum(b * lab.byte_s(8, b) for b in project._rounds(n, 8))
    assert lab.compute_factor(8) == pytest.approx(1.5 * 4.0**2)
    assert project.step_seconds(lab, n, 8, work) == pytest.approx(max(work * 24 + lat, xfer))
    lat2 = sum(lab.round_s(2, b) for b in project._rounds(n, 2))
    assert project.step_seconds(lab, n, 2, work) == pytest.approx(max(work * 1.5 + lat2, xfer * 2 / 3.5))
    cluster = lab.alone()  # one rank per node: compute as measured alone, latency and transfer add up
    assert cluster.compute_factor(1024) == 1.0
    assert project.step_seconds(cluster, n, 2, work) == pytest.approx(
        work + sum(cluster.round_s(2, b) + b * cluster.beta for b in project._rounds(n, 2)))
    with pytest.raises(ValueError, match="compute_scale=0"):
        project.LinkModel(alpha=1e-6, beta=1e-9, compute_scale=0.0)


def test_compute_terms_are_fitted_on_two_node_counts_and_predict_the_third():
    truth = project.LinkModel(alpha=12e-6, alpha_large=25e-6, beta=8.5e-9, cores=2, latency_share=1.1,
                              token_bucket=True, compute_scale=1.25, compute_share=1.5)
    link = dataclasses.replace(truth, compute_scale=1.0, compute_share=0.0)  # as fitted on all-reduce times
    rows = []
    for p in (2, 4, 8):
        for solver, s, nbytes, work in (("sgd", 1, 16, 6e-6), ("casgd", 32, 32256, 60e-6)):
            row = _glm_row(p, solver, s, work * 1024 / s, 0.0, nbytes)
            row["wall_s"] = project.glm_seconds(truth, row)
            rows.append(row)
    fitted = project.fit_compute(link, [r for r in rows if r["nodes"] in (2, 4)])
    assert (fitted.compute_scale, fitted.compute_share) == pytest.approx((1.25, 1.5))
    checked = project.validate_glm(fitted, rows, {(p, s) for p in (2, 4) for s in ("sgd", "casgd")})
    assert max(abs(r["error"]) for r in checked) < 1e-9
    assert [r["fit"] for r in checked] == [True] * 4 + [False] * 2
    casgd8 = next(r for r in checked if r["nodes"] == 8 and r["solver"] == "casgd")
    sgd8 = next(r for r in checked if r["nodes"] == 8 and r["solver"] == "sgd")
    assert casgd8["predicted_speedup"] == pytest.approx(sgd8["wall_s"] / casgd8["wall_s"])
    # without rows on more ranks than cores the exponent cannot be fitted and stays 0
    assert project.fit_compute(link, [r for r in rows if r["nodes"] == 2]).compute_share == 0.0
    with pytest.raises(ValueError, match="--glm-fit-nodes"):
        project.fit_compute(link, [])


def test_compute_per_rank_is_extrapolated_as_fixed_plus_per_column_part():
    rows = [_glm_row(p, "sgd", 1, 5e-6 + 40e-6 / p, 1.0, 16) for p in (2, 4, 8)]
    assert project.compute_at(rows, 1024) == pytest.approx(5e-6 + 40e-6 / 1024)
    assert project.compute_at(rows[:1], 4) == pytest.approx(rows[0]["compute_s"] / 2)


def test_glm_files_without_compute_are_refused_and_files_with_it_are_validated(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"table": "headline", "ranks": 2}]))
    with pytest.raises(ValueError, match="rerun commwire bench glm"):
        project._load_glm([str(old)])
    link = project.LinkModel(alpha=20e-6, alpha_large=40e-6, beta=8e-9, cores=2, latency_share=1.0,
                             token_bucket=True, compute_scale=1.2, compute_share=1.0)
    cal, glm = tmp_path / "cal.json", []
    cal.write_text(json.dumps([{"ranks": p, "bytes": n, "raw_us": project.allreduce_seconds(link, n, p) * 1e6}
                               for p in (2, 4, 8) for n in (16, 4096, 1 << 16, 1 << 20, 1 << 24)]))
    for p in (2, 4, 8):
        for solver, precision, s, nbytes, work in (("sgd", "fp32", 1, 16, 6e-6), ("casgd", "mixed", 32, 32256, 5e-5)):
            row = _glm_row(p, solver, s, work * 1024 / s, 0.0, nbytes)
            glm.append({"table": "headline", "ranks": p, "dataset": "d", "solver": solver, "precision": precision,
                        "s": s, "b": 4, "steps": 1024, "bytes_per_outer": nbytes, "compute_s": row["compute_s"],
                        "wall_s": project.glm_seconds(link, row)})
    path = tmp_path / "glm.json"
    path.write_text(json.dumps(glm))
    assert project.main(["--calibrate", str(cal), "--glm", str(path), "--nodes", "2,1024",
                         "--codecs", "fp8-e4m3", "--size", "1M"]) == 0
    out = capsys.readouterr().out
    assert "8 nodes: max |error| of 2 held-out loops" in out and "| d: nodes |" in out and "\n| 1024 | " in out


def test_codec_rows_are_checked_at_the_segment_they_ran_with(tmp_path):
    link = project.LinkModel(alpha=20e-6, alpha_large=40e-6, beta=8e-9)
    n, seg = 16 << 20, float(4 << 20)
    ran = project.compressed_seconds(link, n, 4, wire_ratio=0.25, enc_Bps=2e9, dec_Bps=4e9, segment=seg)
    assert ran >= project.compressed_seconds(link, n, 4, wire_ratio=0.25, enc_Bps=2e9, dec_Bps=4e9)
    path = tmp_path / "codec.json"
    path.write_text(json.dumps([{"ranks": 4, "bytes": n, "codec": "fp8-e4m3", "raw_us": 1e5,
                                 "commwire_us": ran * 1e6, "segment_bytes": seg}]))
    (row,) = project.validate_codec(link, project._load_codec([str(path)]), {"fp8-e4m3": (2e9, 4e9, 0.25)})
    assert row["error"] == pytest.approx(0.0, abs=1e-12)


def test_a_loop_on_the_lab_starts_with_a_full_bucket():
    from commwire.lab.bandwidth import tbf_burst

    assert tbf_burst(10**9) == 125_000 and tbf_burst(100 * 10**6) == 64 * 1024  # 1 ms of traffic, >= 64 KiB
    lab = project.LinkModel(alpha=10e-6, beta=8e-9, token_bucket=True, burst_bytes=125_000.0)
    row = _glm_row(2, "casgd", 32, 0.0, 1.0, 32256)  # 32 exchanges of 32256 B: rank sends 32256 B each
    k, volume = row["exchanges"], 32256.0
    assert project.glm_seconds(lab, row) == pytest.approx((k * volume - 125_000) * 8e-9)
    # the bucket credit is spent once per loop, not per exchange, and never below zero
    assert project.glm_seconds(lab, dict(row, exchanges=1)) == pytest.approx(
        project._loop_terms(lab, dict(row, exchanges=1), 2)[0])
    with pytest.raises(ValueError, match="burst_bytes"):
        project.LinkModel(alpha=1e-6, beta=1e-9, burst_bytes=-1.0)
    assert project.LinkModel(alpha=1e-6, beta=1e-9, burst_bytes=5.0).alone().burst_bytes == 0.0


def _casgd_step_by_hand(alpha, alpha_large, beta, bucket, p, b, s, compute):
    """Per-step CA-SGD time written out for p = 2 or 4 (MPICH's rounds), independent of project's helpers."""
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
    link = project.LinkModel(alpha=alpha, alpha_large=alpha_large, beta=beta, token_bucket=bucket)
    cands = (1, 2, 4, 8, 16, 32, 64)
    # local work per exchange: a fixed loop cost plus a Gram of (1 + s b)^2 entries over 128 columns
    compute = {s: 10e-6 + gram_ns * 1e-9 * (1 + s * b) ** 2 * 128 / 64 for s in cands}
    best, per_step = project.choose_s(link, p, b, compute)
    by_hand = {s: _casgd_step_by_hand(alpha, alpha_large, beta, bucket, p, b, s, c) for s, c in compute.items()}
    assert per_step == pytest.approx(by_hand, rel=1e-12)
    assert best == min(by_hand, key=by_hand.get) == expected[bucket]
    assert project.casgd_step_seconds(link, p, b, best, compute[best]) == pytest.approx(by_hand[best])


def test_choose_s_breaks_ties_towards_the_smaller_s_and_skips_unmeasured():
    link = project.LinkModel(alpha=0.0, beta=1.0)  # one rank: no messages
    best, per_step = project.choose_s(link, 1, 8, {1: 2e-6, 2: 4e-6, 4: math.inf})
    assert best == 1 and per_step[4] == math.inf
    with pytest.raises(ValueError, match="no candidate s"):
        project.choose_s(link, 1, 8, {})
    assert project.sstep_words(32, 4) == 32 * 4 + 496 * 16


def test_choose_s_with_a_margin_takes_the_smallest_s_near_the_best():
    link = project.LinkModel(alpha=0.0, beta=1.0)  # one rank: the modelled step is the work over s
    compute = {8: 8 * 12e-6, 16: 16 * 10.5e-6, 32: 32 * 10e-6, 64: 64 * 9.8e-6}
    assert project.choose_s(link, 1, 4, compute)[0] == 64  # the argmin
    assert project.choose_s(link, 1, 4, compute, margin=0.1)[0] == 16  # 10.5 within 10% of 9.8; 12 is not
    assert project.choose_s(link, 1, 4, compute, margin=0.25)[0] == 8
    with pytest.raises(ValueError, match=r"margin=1.5 must be in \[0, 1\)"):
        project.choose_s(link, 1, 4, compute, margin=1.5)


@pytest.mark.parametrize("bucket", [False, True])
def test_fit_link_recovers_the_shape_of_the_link(bucket):
    truth = project.LinkModel(alpha=60e-6, alpha_large=90e-6, beta=8e-9, token_bucket=bucket)
    sizes = [16, 96, 448, 1920, 7936, 32256, 130048]
    samples = [(4, float(n), project.allreduce_seconds(truth, n, 4)) for n in sizes]
    fitted = project.fit_link(samples)
    assert fitted.token_bucket == bucket
    assert (fitted.alpha, fitted.alpha_large, fitted.beta) == pytest.approx((60e-6, 90e-6, 8e-9), rel=1e-6)
    with pytest.raises(ValueError, match="determine a bandwidth"):
        project.fit_link([(4, 16.0, 1e-4)])
