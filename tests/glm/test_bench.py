"""commwire.bench.glm on a tiny scale — tier 1 (single process); the example under mpiexec — tier 2."""

from __future__ import annotations

import math

import pytest

from commwire.bench import glm as bench
from _reference import words
from mpi_helpers import run_mpi


def test_rows_count_exchanges_bytes_and_compare_to_fp32_sgd(capsys) -> None:
    rows = bench.run_glm_bench(datasets=["poisson"], sweep=["susy-like"], s=4, b=8, s_values=(1, 8),
                               b_values=(8,), steps=64, sweep_steps=40, auto=[], repeats=1, scale=0.002)
    head = [r for r in rows if r["table"] == "headline"]
    assert [(r["solver"], r["precision"]) for r in head] == [
        ("sgd", "fp32"), ("sgd", "mixed"), ("casgd", "fp32"), ("casgd", "mixed")]
    for r in rows:
        assert r["allreduces"] == math.ceil(r["steps"] / r["s"])
        itemsize = 8 if r["precision"] == "fp64" else 4
        assert r["bytes_per_outer"] == words(r["s"], r["b"]) * itemsize
        assert r["wall_s"] > 0 and r["speedup_vs_sgd_fp32"] > 0
        assert 0 < r["compute_s"] and r["compute_us_per_step"] == pytest.approx(r["compute_s"] / r["steps"] * 1e6)
        assert abs(r["loss_gap_vs_sgd_fp32"]) < 5e-3
    assert head[0]["speedup_vs_sgd_fp32"] == 1.0 and head[0]["loss_gap_vs_sgd_fp32"] == 0.0
    assert {(r["s"], r["b"]) for r in rows if r["table"] == "sweep"} == {(1, 8), (8, 8)}
    text = bench.format_table(rows)
    assert "### headline" in text and "### sweep" in text and "speed-up vs FP32 SGD" in text


def test_auto_table_runs_to_tol_and_sets_auto_beside_the_best_fixed_s() -> None:
    rows = bench.run_glm_bench(datasets=[], sweep=[], auto=["logistic-20k"], auto_b=(4, 16), auto_s=(2, 4),
                               tol=1e-3, max_iter=8, n_iter_no_change=2, repeats=1, scale=0.01)
    assert [(r["b"], r["solver"], r["s_setting"]) for r in rows] == [
        (4, "sgd", 1), (4, "casgd", 2), (4, "casgd", 4), (4, "casgd", "auto"),
        (16, "sgd", 1), (16, "casgd", 2), (16, "casgd", 4), (16, "casgd", "auto")]
    for r in rows:
        assert r["table"] == "auto" and r["m"] == 200 and r["tol"] == 1e-3
        assert r["epochs"] <= 8 and r["steps"] <= 8 * (200 // r["b"])
        assert r["allreduces"] == math.ceil(r["steps"] / r["s"])  # the loop's; the tuning's are left out
        assert r["speedup_per_step"] > 0 and r["speedup_vs_sgd_fp32"] == r["speedup_per_step"]
        assert abs(r["loss_gap_vs_sgd_fp32"]) < 5e-3
    auto = [r for r in rows if r["s_setting"] == "auto"]
    assert all(r["tune_s"] > 0 and r["s_chosen"] == [r["s"]] for r in auto)
    summary = bench.summarize_auto(rows)
    assert [(x["b"], x["auto_s"]) for x in summary] == [(4, auto[0]["s_chosen"]), (16, auto[1]["s_chosen"])]
    fixed4 = [r for r in rows if r["b"] == 4 and r["s_setting"] in (2, 4)]
    assert summary[0]["best_speedup"] == max(r["speedup_per_step"] for r in fixed4)
    assert summary[0]["auto_vs_best"] == pytest.approx(auto[0]["speedup_per_step"] / summary[0]["best_speedup"])
    text = bench.format_table(rows)
    assert "### auto: s chosen at fit time" in text and "| logistic-20k | 4 | " in text and "auto → " in text


def test_main_prints_tables(capsys) -> None:
    assert bench.main(["--datasets", "susy-like", "--sweep", "", "--auto", "", "--steps", "32", "--repeats", "1",
                       "--scale", "0.001", "--s", "4", "--b", "8"]) == 0
    assert "| susy-like | 1000 x 28 | casgd | mixed | 4 | 8 | 32 |" in capsys.readouterr().out


def test_unknown_data_set_raises() -> None:
    with pytest.raises(ValueError, match=r"data set 'higgs' is unknown"):
        bench.run_glm_bench(datasets=["higgs"], sweep=[])


@pytest.mark.mpi
def test_example_prints_both_solvers(tmp_path) -> None:
    data = tmp_path / "demo.svm"
    proc = run_mpi(2, ["examples/glm_casgd.py", str(data), "--demo", "--demo-shape", "2000,8", "--s", "4",
                       "--b", "8", "--epochs", "1"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "sgd (fp32, s=1)" in out and "casgd (mixed, s=4)" in out
    sgd_line = next(line for line in out.splitlines() if line.startswith("sgd (fp32"))
    assert sgd_line.split()[-2] == "250"  # one allreduce per step: 2000 // 8 steps
    assert "CA-SGD vs SGD:" in out
