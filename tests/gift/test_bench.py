"""The GIFT evaluation (benchmarks/gift.py, a research study run from a checkout) on a tiny model — tier 1."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from research import load  # noqa: E402

gift_bench = load("gift")


def test_quick_evaluation_reports_every_codec_against_the_fp32_reference(tmp_path):
    cfg = gift_bench.GiftBenchConfig.quick()
    result = gift_bench.run_gift_bench(cfg, out=tmp_path, argv=["--quick"])
    rows = {r["spec"]: r for r in result["rows"]}
    assert list(rows) == list(cfg.codecs) and len(result["runs"]) == len(cfg.codecs) * len(cfg.seeds)
    # FP32 is the reference itself, up to float32 rounding of the float64 average; 4 bytes per value.
    assert rows["none"]["euclid"][0] < 1e-6 and rows["none"]["bytes_per_value"] == 4.0
    fp8, nvfp4, gift = rows["fp8-e4m3"], rows["nvfp4"], rows[cfg.codecs[-1]]
    # Quantisation errors: finite, non-zero, FP4 coarser than FP8 (E4M3: ~3% relative; NVFP4: ~10%). In
    # Adam's units NVFP4 is far worse (> 1): it flushes small coordinates that Adam's 1/sqrt(v) magnifies.
    for row in (fp8, nvfp4, gift):
        assert 0.0 < row["euclid"][0] < 0.5 and 0.0 < row["adam"][0] < 100.0
        assert np.isfinite(row["final_val"][0]) and 0.0 < row["final_val"][0] < 8.0
    assert 0.01 < fp8["euclid"][0] < 0.06 and fp8["adam"][0] < 0.2
    assert nvfp4["euclid"][0] > 2 * fp8["euclid"][0] and nvfp4["adam"][0] > 5 * fp8["adam"][0]
    assert nvfp4["hits_pct"][0] > fp8["hits_pct"][0] and rows["none"]["hits_pct"][0] == 0.0
    # Bytes on the wire per value: 1 byte + scales for FP8, 4.5 bits + scales for NVFP4.
    assert 1.0 <= fp8["bytes_per_value"] < 1.1 and 0.56 <= nvfp4["bytes_per_value"] < 0.6
    # GIFT profiled, then whitened some layers on every seed, keeping the whitened gradient's size.
    assert all(sel for sel in gift["selection"]) and gift["norm_ratio"] is not None
    lo, hi = gift["norm_ratio"]
    assert 0.1 < lo <= hi < 10.0
    # Paired gaps to direct FP8: zero for FP8 itself.
    assert fp8["vs_fp8"] == (0.0, 0.0)
    table = gift_bench.format_table(result["rows"])
    assert table.count("\n") == len(cfg.codecs) + 1
    assert any(v.startswith("Target:") for v in gift_bench.verdicts(result["rows"]))
    report = (tmp_path / "gift_report.md").read_text()
    assert "Verdicts" in report and "validation loss" in report.lower()
    saved = json.loads((tmp_path / "gift_results.json").read_text())
    assert saved["rows"][1]["spec"] == "fp8-e4m3"


def test_bad_configuration_names_the_field():
    with pytest.raises(ValueError, match="layout='rows'"):
        gift_bench.GiftBenchConfig(layout="rows")
    with pytest.raises(ValueError, match="measure_from=0"):
        gift_bench.GiftBenchConfig(measure_from=0)
