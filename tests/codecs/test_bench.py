"""The codec benchmark library runs and reports every documented column (tiny sizes)."""

import math

from commwire.bench.codecs import format_table, main, run_codec_bench


def test_run_codec_bench_rows_and_table(capsys):
    rows = run_codec_bench(sizes=[0.0625], codecs=["fp8-e4m3", "nvfp4"], repeats=1)
    assert [r["codec"] for r in rows] == ["fp8-e4m3", "nvfp4"]
    for r in rows:
        assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0 and r["memcpy_gbps"] > 0
        assert math.isclose(r["encode_ratio"], r["encode_gbps"] / r["memcpy_gbps"])
        assert 0 < r["rel_l2_gauss"] < 0.2 and 0 < r["rel_l2_grads"] < 0.2
    assert rows[1]["bytes_per_elem"] == (0.5625 * rows[1]["n"] + 4) / rows[1]["n"]
    table = format_table(rows)
    assert "enc/mc" in table and "nvfp4" in table
    assert main(["--sizes", "0.01", "--codecs", "fp16", "--repeats", "1"]) == 0
    assert "fp16" in capsys.readouterr().out
