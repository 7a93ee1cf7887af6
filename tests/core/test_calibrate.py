"""The cost model's calibration (benchmarks/calibrate.py, a research study run from a checkout) — tier 1.

Synthetic measurement files with known parameters: the fit recovers them and the
held-out rows are predicted.
"""

import dataclasses
import json
import math

import pytest

from commwire import costmodel as cm
from research import load

calibrate = load("calibrate")


def test_fitted_model_validates_exactly_and_files_load_as_samples(tmp_path):
    truth = cm.LinkModel(alpha=20e-6, alpha_large=45e-6, beta=8e-9)
    samples = [(p, n, cm.allreduce_seconds(truth, n, p)) for p in (2, 4, 8) for n in (16, 4096, 1 << 20, 1 << 24)]
    fitted = cm.fit(samples[:4])  # two nodes only
    assert max(abs(r["error"]) for r in calibrate.validate(fitted, samples)) < 1e-6
    path = tmp_path / "cal.json"
    path.write_text(json.dumps([{"ranks": p, "bytes": n, "raw_us": t * 1e6} for p, n, t in samples]))
    loaded = calibrate.load_samples([str(path)])
    assert [(p, n) for p, n, _ in loaded] == [(p, n) for p, n, _ in samples]
    assert [t for *_, t in loaded] == pytest.approx([t for *_, t in samples])


def test_codec_rows_are_validated_as_times_and_speedups(tmp_path):
    link = cm.LinkModel(alpha=20e-6, alpha_large=40e-6, beta=8e-9, cores=2, latency_share=1.0,
                        bandwidth_share=0.2, token_bucket=True)
    rates = {"fp8-e4m3": (2e9, 4e9, 0.25)}
    n = 64 << 20
    t32 = cm.allreduce_seconds(link, n, 4)
    t8 = cm.compressed_seconds(link, n, 4, wire_ratio=0.25, enc_Bps=2e9, dec_Bps=4e9)
    path = tmp_path / "codec.json"
    path.write_text(json.dumps([{"ranks": 4, "bytes": n, "codec": "fp8-e4m3", "raw_us": t32 * 1e6,
                                 "commwire_us": t8 * 1.25e6}]))
    assert calibrate.load_samples([str(path)]) == []  # compressed rows are not FP32 samples
    (row,) = calibrate.validate_codec(link, calibrate.load_codec_rows([str(path)]), rates)
    assert row["error"] == pytest.approx(1 / 1.25 - 1)
    assert row["predicted_speedup"] == pytest.approx(t32 / t8) and row["speedup"] == pytest.approx(t32 / t8 / 1.25)


def _glm_row(nodes, solver, s, compute_s, wall_s, nbytes, steps=1024, dataset="d"):
    return {"nodes": nodes, "dataset": dataset, "solver": solver, "precision": "fp32", "s": s, "b": 4,
            "steps": steps, "bytes": float(nbytes), "exchanges": math.ceil(steps / s), "wall_s": wall_s,
            "compute_s": compute_s}


def test_compute_terms_are_fitted_on_two_node_counts_and_predict_the_third():
    truth = cm.LinkModel(alpha=12e-6, alpha_large=25e-6, beta=8.5e-9, cores=2, latency_share=1.1,
                         token_bucket=True, compute_scale=1.25, compute_share=1.5)
    link = dataclasses.replace(truth, compute_scale=1.0, compute_share=0.0)  # as fitted on all-reduce times
    rows = []
    for p in (2, 4, 8):
        for solver, s, nbytes, work in (("sgd", 1, 16, 6e-6), ("casgd", 32, 32256, 60e-6)):
            row = _glm_row(p, solver, s, work * 1024 / s, 0.0, nbytes)
            row["wall_s"] = calibrate.glm_seconds(truth, row)
            rows.append(row)
    fitted = calibrate.fit_compute(link, [r for r in rows if r["nodes"] in (2, 4)])
    assert (fitted.compute_scale, fitted.compute_share) == pytest.approx((1.25, 1.5))
    checked = calibrate.validate_glm(fitted, rows, {(p, s) for p in (2, 4) for s in ("sgd", "casgd")})
    assert max(abs(r["error"]) for r in checked) < 1e-9
    assert [r["fit"] for r in checked] == [True] * 4 + [False] * 2
    casgd8 = next(r for r in checked if r["nodes"] == 8 and r["solver"] == "casgd")
    sgd8 = next(r for r in checked if r["nodes"] == 8 and r["solver"] == "sgd")
    assert casgd8["predicted_speedup"] == pytest.approx(sgd8["wall_s"] / casgd8["wall_s"])
    # without rows on more ranks than cores the exponent cannot be fitted and stays 0
    assert calibrate.fit_compute(link, [r for r in rows if r["nodes"] == 2]).compute_share == 0.0
    with pytest.raises(ValueError, match="--glm-fit-nodes"):
        calibrate.fit_compute(link, [])


def test_compute_per_rank_is_extrapolated_as_fixed_plus_per_column_part():
    rows = [_glm_row(p, "sgd", 1, 5e-6 + 40e-6 / p, 1.0, 16) for p in (2, 4, 8)]
    assert calibrate.compute_at(rows, 1024) == pytest.approx(5e-6 + 40e-6 / 1024)
    assert calibrate.compute_at(rows[:1], 4) == pytest.approx(rows[0]["compute_s"] / 2)


def test_glm_files_without_compute_are_refused_and_files_with_it_are_validated(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"table": "headline", "ranks": 2}]))
    with pytest.raises(ValueError, match="rerun commwire bench glm"):
        calibrate.load_glm([str(old)])
    link = cm.LinkModel(alpha=20e-6, alpha_large=40e-6, beta=8e-9, cores=2, latency_share=1.0,
                        token_bucket=True, compute_scale=1.2, compute_share=1.0)
    cal, glm = tmp_path / "cal.json", []
    cal.write_text(json.dumps([{"ranks": p, "bytes": n, "raw_us": cm.allreduce_seconds(link, n, p) * 1e6}
                               for p in (2, 4, 8) for n in (16, 4096, 1 << 16, 1 << 20, 1 << 24)]))
    for p in (2, 4, 8):
        for solver, precision, s, nbytes, work in (("sgd", "fp32", 1, 16, 6e-6), ("casgd", "mixed", 32, 32256, 5e-5)):
            row = _glm_row(p, solver, s, work * 1024 / s, 0.0, nbytes)
            glm.append({"table": "headline", "ranks": p, "dataset": "d", "solver": solver, "precision": precision,
                        "s": s, "b": 4, "steps": 1024, "bytes_per_outer": nbytes, "compute_s": row["compute_s"],
                        "wall_s": calibrate.glm_seconds(link, row)})
    path = tmp_path / "glm.json"
    path.write_text(json.dumps(glm))
    assert calibrate.main(["--calibrate", str(cal), "--glm", str(path), "--nodes", "2,1024",
                           "--codecs", "fp8-e4m3", "--size", "1M"]) == 0
    out = capsys.readouterr().out
    assert "8 nodes: max |error| of 2 held-out loops" in out and "| d: nodes |" in out and "\n| 1024 | " in out


def test_codec_rows_are_checked_at_the_segment_they_ran_with(tmp_path):
    link = cm.LinkModel(alpha=20e-6, alpha_large=40e-6, beta=8e-9)
    n, seg = 16 << 20, float(4 << 20)
    ran = cm.compressed_seconds(link, n, 4, wire_ratio=0.25, enc_Bps=2e9, dec_Bps=4e9, segment=seg)
    assert ran >= cm.compressed_seconds(link, n, 4, wire_ratio=0.25, enc_Bps=2e9, dec_Bps=4e9)
    path = tmp_path / "codec.json"
    path.write_text(json.dumps([{"ranks": 4, "bytes": n, "codec": "fp8-e4m3", "raw_us": 1e5,
                                 "commwire_us": ran * 1e6, "segment_bytes": seg}]))
    (row,) = calibrate.validate_codec(link, calibrate.load_codec_rows([str(path)]), {"fp8-e4m3": (2e9, 4e9, 0.25)})
    assert row["error"] == pytest.approx(0.0, abs=1e-12)


def test_a_loop_on_the_lab_starts_with_a_full_bucket():
    from commwire.lab.bandwidth import tbf_burst

    assert tbf_burst(10**9) == 125_000 and tbf_burst(100 * 10**6) == 64 * 1024  # 1 ms of traffic, >= 64 KiB
    lab = cm.LinkModel(alpha=10e-6, beta=8e-9, token_bucket=True, burst_bytes=125_000.0)
    row = _glm_row(2, "casgd", 32, 0.0, 1.0, 32256)  # 32 exchanges of 32256 B: rank sends 32256 B each
    k, volume = row["exchanges"], 32256.0
    assert calibrate.glm_seconds(lab, row) == pytest.approx((k * volume - 125_000) * 8e-9)
    # the bucket credit is spent once per loop, not per exchange, and never below zero
    assert calibrate.glm_seconds(lab, dict(row, exchanges=1)) == pytest.approx(
        calibrate.loop_terms(lab, dict(row, exchanges=1), 2)[0])
    with pytest.raises(ValueError, match="burst_bytes"):
        cm.LinkModel(alpha=1e-6, beta=1e-9, burst_bytes=-1.0)
    assert cm.LinkModel(alpha=1e-6, beta=1e-9, burst_bytes=5.0).alone().burst_bytes == 0.0
