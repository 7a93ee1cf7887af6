"""Several jobs of one benchmark merged row by row (benchmarks/jobs.py, a study run from a checkout) — tier 1."""

import pytest

from research import load

jobs = load("jobs")

KEY = ["ranks", "bytes", "kind", "arm"]


def _row(arm, kind, ratio, **extra):
    return {"ranks": 4, "bytes": 1 << 20, "kind": kind, "arm": arm, "ratio": ratio, "median_ms": 9.0, **extra}


def test_merge_gives_every_jobs_value_its_median_range_and_jobs_within_the_kinds_limit():
    runs = [[_row("gloo", "fp32", 1.0), _row("torch", "fp32", 1.07), _row("torch", "fp8", 1.5, segment_bytes=1)],
            [_row("gloo", "fp32", 1.0), _row("torch", "fp32", 1.02), _row("torch", "fp8", 0.9)],
            [_row("gloo", "fp32", 1.0), _row("torch", "fp32", 1.04)]]  # a size that failed in the last job
    merged = jobs.merge(runs, KEY, "ratio", {"fp32": 1.05})
    assert [(r["arm"], r["kind"]) for r in merged] == [("gloo", "fp32"), ("torch", "fp32"), ("torch", "fp8")]
    torch32, torch8 = merged[1], merged[2]
    assert torch32["values"] == [1.07, 1.02, 1.04]
    assert (torch32["median"], torch32["min"], torch32["max"], torch32["jobs_within"]) == (1.04, 1.02, 1.07, 2)
    assert torch8["values"] == [1.5, 0.9] and torch8["median"] == pytest.approx(1.2) and torch8["limit"] is None
    table = jobs.format_table(merged, KEY, "ratio", 3)
    assert "| 4 | 1 MiB | fp32 | torch | 1.070 / 1.020 / 1.040 | 1.040 | 1.020–1.070 | 2/3 (≤ 1.05) |" in table
    assert "| 4 | 1 MiB | fp8 | torch | 1.500 / 0.900 | 1.200 | 0.900–1.500 | - |" in table


def test_a_star_limit_applies_to_rows_without_a_kind_or_a_limit_of_their_own():
    runs = [[{"config": "DDP", "ratio_vs_ddp": 1.0}, {"config": "commwire fp32", "ratio_vs_ddp": 0.99}],
            [{"config": "DDP", "ratio_vs_ddp": 1.0}, {"config": "commwire fp32", "ratio_vs_ddp": 1.02}]]
    merged = jobs.merge(runs, ["config"], "ratio_vs_ddp", {"*": 1.0, "fp8": 2.0})
    assert [r["jobs_within"] for r in merged] == [2, 1] and merged[1]["limit"] == 1.0


@pytest.mark.parametrize("text, message", [
    ("fp32", "--within 'fp32': give KIND=LIMIT"),
    ("fp32=x", "--within 'fp32=x'"),
    ("fp32=-1", "--within 'fp32=-1'"),
    ("=1.05", "--within '=1.05'"),
])
def test_bad_limits_are_refused_naming_the_entry(text, message):
    with pytest.raises(ValueError, match=message):
        jobs.parse_within(text)


def test_a_key_the_rows_lack_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match="a row has no field 'codec' .*choose --key and --value among them"):
        jobs.merge([[_row("gloo", "fp32", 1.0)]], ["codec"], "ratio", {})


@pytest.mark.mpi
def test_two_real_jobs_of_the_transports_benchmark_merge_into_one_table(capsys):
    pytest.importorskip("torch")
    argv = ["--jobs", "2", "-np", "2", "--within", "fp32=1e9", "--", "transports", "--sizes", "64K", "--repeats",
            "1", "--codec", ""]
    assert jobs.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 | 64 KiB |")]
    assert len(lines) == 4, lines  # gloo, both transports, MPICH's own
    baseline = lines[0].split(" | ")
    assert baseline[3] == "torch.distributed (gloo)" and baseline[4] == "1.000 / 1.000"
    for line in lines:
        values = [float(v) for v in line.split(" | ")[4].split(" / ")]
        assert len(values) == 2 and all(v > 0 for v in values) and line.endswith("| 2/2 (≤ 1e+09) |"), line


def test_the_benchmarks_own_json_option_is_refused(capsys):
    with pytest.raises(SystemExit):
        jobs.main(["--", "transports", "--json", "x.json"])
    assert "leave --json out" in capsys.readouterr().err
