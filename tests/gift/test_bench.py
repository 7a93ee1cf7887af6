"""The GIFT evaluation's error part on a tiny model in one process — tier 1."""

import pytest

pytest.importorskip("torch")


def test_error_part_reports_every_variant_per_layer_and_pooled(tmp_path):
    from commwire.bench.gift import GiftBenchConfig, _markdown, format_table, run_error_part

    cfg = GiftBenchConfig(d_model=32, layers=1, context=16, batch=2, warmup=2, stat_steps=3, error_steps=2, steps=0,
                          error_codecs=("fp8-e4m3", "gift:ef=0,rank=8+fp8-e4m3", "gift:rank=8+nvfp4"))
    errors = run_error_part(cfg)
    assert errors["linears"] == ["blocks.0.down.weight", "blocks.0.proj.weight", "blocks.0.qkv.weight",
                                 "blocks.0.up.weight"]
    assert len(errors["rows"]) == 6
    for row in errors["rows"].values():
        for layer in errors["linears"] + ["all weights", "all params"]:
            assert all(0.0 < v < 10.0 for v in row[layer].values())
    # the bare transform is exactly undone: its Euclidean error is a quantisation error, not a bias
    assert errors["rows"]["gift:ef=0,rank=8+fp8-e4m3|tensor"]["all weights"]["euclid"] < 0.2
    table = format_table(errors, "bucket", "a_norm")
    assert table.count("\n") == 4 and "b0.down" in table
    report = _markdown({"errors": errors, "ranks": 1}, cfg, [], [])
    assert "Verdicts" in report and "A⁻¹-norm" in report
