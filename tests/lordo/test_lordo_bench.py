"""The LoRDO learning-rate sweep (benchmarks/lordo.py, a research study run from a checkout) — tier 1
(report, arms, one tiny sweep in this process, the script's command line) and tier 2 (the script under
``commwire run -np 2``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from research import load  # noqa: E402

bench = load("lordo")
ROOT = Path(__file__).resolve().parents[2]


def _rows():
    rows = []
    for arm, label, base, nbytes in (("ddp", "DDP-Adam", 2.0, 1000.0), ("lowrank-ddp", "low-rank DDP", 2.1, 1000.0),
                                     ("lordo", "LoRDO", 2.15, 70.0), ("lordo-omega1", "LoRDO ω=1", 2.4, 70.0)):
        for lr, shift in ((1e-3, 0.1), (2e-3, 0.0), (4e-3, 0.05)):
            for seed in range(3):
                row = {"arm": arm, "label": label, "lr": lr, "seed": seed, "val": base + shift + 0.01 * seed,
                       "bytes_per_step": nbytes, "state_bytes": 1 << 20, "wall_s": 1.0}
                if arm.startswith("lordo"):
                    one = arm == "lordo-omega1"
                    row["stagnation"] = {"similarity": 1.0 if one else 0.9, "min_similarity": 1.0 if one else 0.8,
                                         "max_rank": 4 if one else 30, "min_rank": 4 if one else 20,
                                         "rank_le_r": 1.0 if one else 0.0}
                rows.append(row)
    return rows


def test_summary_picks_the_best_mean_lr_and_reports_mean_and_std():
    summary = bench.summarize(_rows())
    assert summary["ddp"]["best_lr"] == 2e-3 and not summary["ddp"]["edge"]
    assert summary["lordo"]["mean"] == pytest.approx(2.16)
    assert summary["lordo"]["std"] == pytest.approx(0.01)
    text = bench.format_report(summary, bench.Setup(rank=4), 4, (0, 1, 2))
    assert "| LoRDO | 0.002 | 2.1600 ± 0.0100 | +7.46% | +2.37% | 0.1 kB | 14.3× |" in text
    assert "LoRDO vs low-rank DDP: +2.37% (target ≤ +3%): met" in text
    assert "LoRDO vs DDP-Adam: +7.46% (target ≤ +5%): NOT met" in text
    assert "shown" in text and "| LoRDO ω=1 | 1.0000 | 1.0000 | 4–4 | 100% |" in text


def test_report_merges_sweeps_that_extend_the_grid_and_refuses_mixed_setups(tmp_path):
    rows = _rows()
    setup = dataclasses.asdict(bench.Setup(rank=4))
    lrs = sorted({r["lr"] for r in rows})
    first, second, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps({"setup": setup, "ranks": 4, "rows": [r for r in rows if r["lr"] != lrs[-1]]}))
    second.write_text(json.dumps({"setup": setup, "ranks": 4, "rows": [r for r in rows if r["lr"] == lrs[-1]]}))
    merged = bench.merged_report([str(first), str(second)])
    assert merged == bench.format_report(bench.summarize(rows), bench.Setup(rank=4), 4, (0, 1, 2))
    other.write_text(json.dumps({"setup": {**setup, "steps": 7}, "ranks": 4, "rows": []}))
    with pytest.raises(ValueError, match=r"differs in \['steps'\]"):
        bench.merged_report([str(first), str(other)])
    with pytest.raises(ValueError, match="seed 0 is also in"):
        bench.merged_report([str(first), str(first)])


def test_bench_runs_one_tiny_sweep_in_process(capsys):
    bench.main(["--quick", "--arms", "ddp,lordo,lordo-warmup,lordo-k1,lordo-ddp,streaming-diloco-nvfp4", "--lrs",
                "4e-3", "--seeds", "1", "--steps", "16"])
    out = capsys.readouterr().out
    assert "| LoRDO |" in out and "| DDP-Adam |" in out and "Acceptance" in out
    assert "| Streaming DiLoCo P=4 τ=1 α=0.5, NVFP4 Δ |" in out
    assert "| LoRDO K=1 (diagnostic) |" in out
    assert "| LoRDO optimizer on DDP gradients (diagnostic) |" in out


@pytest.mark.parametrize("steps, k, warmup", [(20, 8, 24), (16, 8, 16), (256, 16, 256)])
def test_lordo_ddp_arm_stays_in_its_ddp_warmup_for_the_whole_run(steps, k, warmup):
    from commwire.bench.lm import LMConfig, make_lm

    setup = bench.Setup(d_model=16, layers=1, heads=2, context=8, steps=steps, sync_every=k, rank=2)
    model = make_lm(LMConfig(d_model=16, layers=1, heads=2, context=8), seed=0)
    opt = bench.build_optimizer(bench.ARMS["lordo-ddp"], model, 1e-3, setup)
    assert opt.config.warmup_steps == warmup
    assert all(opt.config.phase(t).warmup for t in range(1, steps + 1))  # every step averages gradients
    assert opt.config.switch_betas is None and opt.config.phase(1).omega == setup.omega


def test_the_package_cli_names_the_script_and_the_script_refuses_bad_arguments(capsys):
    from commwire.cli import main

    assert main(["bench", "lordo", "--arms", "adam"]) == 2
    err = capsys.readouterr().err
    assert "commwire run -np N python benchmarks/lordo.py" in err and err.count("\n") == 1
    proc = subprocess.run([sys.executable, "benchmarks/lordo.py", "--arms", "adam"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "choose from" in proc.stderr


def test_report_mode_runs_as_a_script_without_mpi(tmp_path):
    rows = _rows()
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"setup": dataclasses.asdict(bench.Setup(rank=4)), "ranks": 4, "rows": rows}))
    proc = subprocess.run([sys.executable, "benchmarks/lordo.py", "--report", str(path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "| LoRDO | 0.002 | 2.1600 ± 0.0100 |" in proc.stdout


@pytest.mark.mpi
def test_commwire_run_launches_the_script_on_two_ranks(tmp_path):
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "-m", "commwire", "run", "-np", "2", sys.executable, "benchmarks/lordo.py",
                           "--quick", "--arms", "ddp,lordo", "--lrs", "4e-3", "--seeds", "1", "--steps", "8",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if "no MPI launcher found" in proc.stderr:
        pytest.skip(proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| LoRDO |" in out.read_text() and "| DDP-Adam |" in out.read_text()
