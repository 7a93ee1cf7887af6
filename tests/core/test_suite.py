"""`commwire bench suite` — tier 1 (report writer, arguments, lab handling against a fake lab)
and tier 2 (one real ``--quick --only allreduce`` run on loopback)."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import subprocess
import sys
import time

import pytest

import commwire.lab
from commwire import launch
from commwire.bench import suite
from commwire.cli import main as cli_main
from commwire.lab.spec import plan as lab_plan

SIZES = (65536, 1 << 20)


def _allreduce_rows(codec: str | None = None) -> list[dict]:
    rows = []
    for nbytes in SIZES:
        raw, ours = nbytes / 1e3, nbytes / 1e3 * (1.1 if codec is None else 0.5)
        row = {"ranks": 4, "bytes": nbytes, "raw_us": raw, "commwire_us": ours, "raw_GBps": nbytes / raw / 1e3,
               "commwire_GBps": nbytes / ours / 1e3, "ratio": ours / raw}
        if codec is not None:
            row.update(codec=codec, encode_us=ours / 4, transfer_us=ours / 2, decode_us=ours / 4,
                       wire_bytes_per_elem=1.0, rel_l2_err=0.03)
        rows.append(row)
    return rows


def _glm_rows() -> list[dict]:
    rows = []
    for dataset in ("susy-like", "poisson"):
        for solver, precision, s, wall in (("sgd", "fp32", 1, 2.0), ("sgd", "mixed", 1, 1.8),
                                           ("casgd", "fp32", 16, 1.0), ("casgd", "mixed", 16, 0.5)):
            rows.append({"table": "headline", "dataset": dataset, "solver": solver, "precision": precision, "s": s,
                         "b": 16, "steps": 256, "ranks": 4, "wall_s": wall, "us_per_step": wall / 256 * 1e6,
                         "wall_best_s": wall, "wall_samples_s": [wall], "allreduces": 256 // s, "bytes": 1000,
                         "bytes_per_outer": 100, "loss": 0.5, "m": 5000, "n": 28, "speedup_vs_sgd_fp32": 2.0 / wall,
                         "best_speedup_vs_sgd_fp32": 2.0 / wall, "loss_gap_vs_sgd_fp32": 0.0001,
                         "small_allreduce_us": [20.0, 21.0]})
    return rows


def _torch_rows() -> list[dict]:
    nan = float("nan")
    return [{"config": "ddp-gloo fp32", "ranks": 4, "tensors": 100, "step_ms": 10.0, "ratio_vs_ddp": 1.0,
             "wire_MB_per_step": 13.0, "collectives_per_step": nan, "hidden_fraction": nan},
            {"config": "commwire fp8-e4m3", "ranks": 4, "tensors": 100, "step_ms": 5.0, "ratio_vs_ddp": 0.5,
             "wire_MB_per_step": 3.3, "collectives_per_step": 1.0, "hidden_fraction": 0.8}]


def _result(bench: str, name: str, where: str, rows: list[dict], rc: int = 0, **kw) -> suite.PartResult:
    return suite.PartResult(bench=bench, name=name, where=where, argv=["python", "-m", "x"], rc=rc, wall_s=1.5,
                            rows=rows, **kw)


def _fake_results() -> list[suite.PartResult]:
    return [
        _result("allreduce", "allreduce fp32", "loopback", _allreduce_rows()),
        _result("allreduce", "allreduce codecs", "loopback", _allreduce_rows("fp8-e4m3") + _allreduce_rows("nvfp4")),
        _result("glm", "glm", "loopback", _glm_rows()),
        _result("allreduce", "allreduce codecs", "lab 1gbit", _allreduce_rows("nvfp4")),
        _result("torch", "torch", "lab 1gbit", _torch_rows()),
        _result("glm", "glm", "lab 1gbit", [], rc=1, error="RuntimeError: boom",
                stderr_tail=["Traceback (most recent call last):", "RuntimeError: boom"]),
    ]


META = {"command": "commwire bench suite --quick", "date": "2025-01-01T00:00:00+00:00",
        "host": {"hostname": "h", "platform": "p", "cpus": 2, "load_average_at_start": [1.0, 1.0, 1.0]},
        "git": {"commit": "0123456789abcdef", "dirty": False}, "wall_s": 12.0}


def test_report_json_markdown_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    files = suite.write_report(tmp_path, META, _fake_results())
    data = json.loads((tmp_path / "suite.json").read_text())
    assert data["meta"]["command"] == "commwire bench suite --quick"
    assert [(p["name"], p["where"], p["rc"]) for p in data["parts"]] == [
        ("allreduce fp32", "loopback", 0), ("allreduce codecs", "loopback", 0), ("glm", "loopback", 0),
        ("allreduce codecs", "lab 1gbit", 0), ("torch", "lab 1gbit", 0), ("glm", "lab 1gbit", 1)]
    assert len(data["parts"][1]["rows"]) == 4 and data["parts"][5]["stderr_tail"][-1] == "RuntimeError: boom"
    md = (tmp_path / "suite.md").read_text()
    assert md.startswith("# commwire benchmark suite\n") and "`commwire bench suite --quick`" in md
    assert md.index("## Headline") < md.index("## allreduce fp32 — loopback") < md.index("## torch — lab 1gbit")
    for header in ("**commwire / mpi4py time**", "**speed-up vs FP32 MPI**", "**speed-up vs FP32 SGD**",
                   "**loss gap**", "**step time vs DDP**"):
        assert header in md
    assert "5 of 6 parts succeeded; failed: glm @ lab 1gbit." in md and "RuntimeError: boom" in md
    assert files["plots"] == ["allreduce_time.png", "allreduce_speedup.png", "glm_speedup.png", "torch_step.png"]
    for name in files["plots"]:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
        assert f"]({name})" in md


def test_headline_takes_the_key_ratio_of_each_part():
    rows = suite.headline(_fake_results())
    by = {(r["part"], r["where"], r["measure"].split(" ")[0]): r for r in rows}
    assert by["allreduce fp32", "loopback", "commwire"]["ratio"] == pytest.approx(1.1)
    fp8 = by["allreduce codecs", "loopback", "fp8-e4m3"]
    assert fp8["ratio"] == pytest.approx(2.0) and "1 MiB" in fp8["measure"]  # largest size
    assert by["allreduce codecs", "lab 1gbit", "nvfp4"]["ratio"] == pytest.approx(2.0)
    glm = [r for r in rows if r["part"] == "glm" and r["where"] == "loopback"]
    assert [r["ratio"] for r in glm] == [pytest.approx(4.0)] * 2 and "susy-like" in glm[0]["measure"]
    torch_rows = [r for r in rows if r["part"] == "torch"]
    assert len(torch_rows) == 1 and torch_rows[0]["ratio"] == 0.5 and torch_rows[0]["baseline"] == "ddp-gloo fp32"
    failed = by["glm", "lab 1gbit", "failed"]
    assert failed["ratio"] is None and failed["note"] == "RuntimeError: boom"


def test_without_matplotlib_json_and_markdown_are_written_and_plots_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    files = suite.write_report(tmp_path, META, _fake_results())
    assert files["plots"] is None and not list(tmp_path.glob("*.png"))
    assert "plots skipped: matplotlib is not installed" in (tmp_path / "suite.md").read_text()
    assert json.loads((tmp_path / "suite.json").read_text())["parts"]


@pytest.mark.parametrize("args, message", [
    (["--only", "allredux"], "--only: unknown benchmark 'allredux'; choose from allreduce,glm,torch"),
    (["--only", ""], "names no benchmark"),
    (["--only", "torch"], "selects no part: torch runs only on the lab; add --lab 1gbit"),
    (["--lab", "1gbps"], "--lab: cannot parse bandwidth '1gbps'"),
    (["--lab", "1gbit,fast"], "--lab: cannot parse bandwidth 'fast'"),
    (["--np", "0"], "--np must be a whole number of ranks >= 1, got 0 (e.g. --np 4)"),
])
def test_bad_arguments_are_refused_naming_the_value(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        suite.main(["--out", str(tmp_path / "r"), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_cli_runs_the_suite_directly_and_passes_np_on(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(suite, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setattr(launch, "build_command", lambda *a, **k: pytest.fail("the suite must not run under mpiexec"))
    assert cli_main(["bench", "suite", "-np", "2", "--quick", "--only", "allreduce"]) == 0
    assert cli_main(["bench", "suite", "--np", "3"]) == 0
    assert seen == [["--np", "2", "--quick", "--only", "allreduce"], ["--np", "3"]]
    monkeypatch.undo()
    assert cli_main(["bench", "suite", "--only", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_plan_quick_loopback_then_each_lab(tmp_path):
    config = suite.SuiteConfig(out=tmp_path, np=2, quick=True, lab=suite.parse_lab("10Gbit,1gbit,1000mbit"))
    assert config.lab == ("10gbit", "1gbit")  # normalised, duplicates dropped
    parts = suite.plan(config)
    assert [(p.name, p.where) for p in parts] == [
        ("allreduce fp32", "loopback"), ("allreduce codecs", "loopback"), ("glm", "loopback"),
        ("allreduce fp32", "lab 10gbit"), ("allreduce codecs", "lab 10gbit"), ("glm", "lab 10gbit"),
        ("torch", "lab 10gbit"),
        ("allreduce fp32", "lab 1gbit"), ("allreduce codecs", "lab 1gbit"), ("glm", "lab 1gbit"),
        ("torch", "lab 1gbit")]
    argv = suite.part_argv(parts[1], 2, tmp_path / "x.json")
    assert argv[1:6] == ["-m", "commwire", "run", "-np", "2"] and "--lab" not in argv
    assert argv[6:] == [sys.executable, "-m", "commwire.bench.allreduce", "--json", str(tmp_path / "x.json"),
                        "--codec", "fp8-e4m3,nvfp4", "--sizes", "64K,1M", "--repeats", "2"]
    assert "--lab" in suite.part_argv(parts[-1], 4, "y.json")
    assert suite.plan(suite.SuiteConfig(out=tmp_path, only=("glm",)))[0].args == ()  # full run: the defaults


@pytest.mark.parametrize("quick", [True, False])
def test_every_part_passes_only_real_options_of_its_benchmark(quick, monkeypatch, tmp_path):
    class Parsed(Exception):
        pass

    def parse_only(self, args=None, namespace=None):
        raise Parsed(*self.parse_known_args(args, namespace))  # bad values still exit

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    for part in suite.plan(suite.SuiteConfig(out=tmp_path, quick=quick, lab=("1gbit",))):
        with pytest.raises(Parsed) as exc:
            importlib.import_module(part.module).main(["--json", "x.json", *part.args])
        namespace, unknown = exc.value.args
        assert unknown == [] and namespace.json_path == "x.json", part


class FakeLab:
    """Stands in for commwire.lab: records up/down, never touches the network."""

    def __init__(self, running=None, up_error=None, down_error=None):
        self.running, self.up_error, self.down_error, self.calls = running, up_error, down_error, []

    def install(self, monkeypatch):
        monkeypatch.setattr(commwire.lab, "require_tools", lambda: {"ip": "ip", "tc": "tc"})
        monkeypatch.setattr(commwire.lab, "status", lambda: self.running)
        monkeypatch.setattr(commwire.lab, "up", self.up)
        monkeypatch.setattr(commwire.lab, "down", self.down)
        monkeypatch.setattr(suite, "_meta", lambda argv: {"command": "test"})
        return self

    def up(self, hosts, bandwidth):
        self.calls.append(("up", hosts, bandwidth))
        if self.up_error:
            raise RuntimeError(self.up_error)
        self.running = lab_plan(hosts, commwire.lab.parse_bandwidth(bandwidth), bandwidth)
        return self.running

    def down(self):
        self.calls.append(("down",))
        if self.down_error:
            raise RuntimeError(self.down_error)
        self.running = None
        return []


def _fake_run_part(log, interrupt_at=None):
    def run(part, index, config, progress):
        log.append((part.name, part.where, commwire.lab.status() is not None))
        if part.where == interrupt_at:
            raise KeyboardInterrupt
        rows = _torch_rows() if part.bench == "torch" else _allreduce_rows()
        return _result(part.bench, part.name, part.where, rows if part.bench != "glm" else _glm_rows())
    return run


def _config(tmp_path, **kw):
    return suite.SuiteConfig(out=tmp_path, np=4, quick=True, quiet=True, **kw)


def test_lab_parts_run_between_up_and_down(tmp_path, monkeypatch):
    lab = FakeLab().install(monkeypatch)
    log = []
    monkeypatch.setattr(suite, "run_part", _fake_run_part(log))
    outcome = suite.run_suite(_config(tmp_path, lab=("10gbit", "1gbit"), only=("torch", "glm")))
    assert lab.calls == [("up", 4, "10gbit"), ("down",), ("up", 4, "1gbit"), ("down",)]
    assert log == [("glm", "loopback", False), ("glm", "lab 10gbit", True), ("torch", "lab 10gbit", True),
                   ("glm", "lab 1gbit", True), ("torch", "lab 1gbit", True)]
    assert not outcome.failed and (tmp_path / "suite.md").exists()


@pytest.mark.parametrize("down_error", [None, "could not remove namespace cw-h1"])
def test_lab_is_torn_down_on_ctrl_c_and_the_partial_report_written(down_error, tmp_path, monkeypatch, capsys):
    lab = FakeLab(down_error=down_error).install(monkeypatch)
    monkeypatch.setattr(suite, "run_part", _fake_run_part([], interrupt_at="lab 1gbit"))
    with pytest.raises(KeyboardInterrupt):  # a failing `down` warns, it does not hide the Ctrl-C
        suite.run_suite(_config(tmp_path, lab=("1gbit", "10gbit"), only=("glm",)))
    assert lab.calls == [("up", 4, "1gbit"), ("down",)]
    assert (lab.running is None) if down_error is None else (down_error in capsys.readouterr().err)
    data = json.loads((tmp_path / "suite.json").read_text())
    assert data["meta"]["interrupted"] is True and [p["where"] for p in data["parts"]] == ["loopback"]
    assert "**Interrupted:**" in (tmp_path / "suite.md").read_text()


def test_a_lab_that_does_not_come_up_is_recorded_and_the_suite_goes_on(tmp_path, monkeypatch):
    FakeLab(up_error="leftovers from an earlier lab exist").install(monkeypatch)
    monkeypatch.setattr(suite, "run_part", _fake_run_part([]))
    outcome = suite.run_suite(_config(tmp_path, lab=("1gbit",), only=("glm",)))
    assert [(r.where, r.rc) for r in outcome.results] == [("loopback", 0), ("lab 1gbit", None)]
    assert "leftovers from an earlier lab exist" in outcome.failed[0].error


def test_a_running_lab_is_reused_when_it_matches_and_refused_otherwise(tmp_path, monkeypatch, capsys):
    running = lab_plan(4, 10**9, "1gbit")
    lab = FakeLab(running=running).install(monkeypatch)
    monkeypatch.setattr(suite, "run_part", _fake_run_part([]))
    suite.run_suite(_config(tmp_path, lab=("1gbit",), only=("torch",)))
    assert lab.calls == [] and lab.running is running  # used as it is, left up
    assert suite.main(["--out", str(tmp_path / "r"), "--lab", "10gbit", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "a lab is already up with 4 hosts at 1gbit" in err and "commwire lab down" in err
    assert "--lab 1gbit" in err and lab.calls == [] and not (tmp_path / "r").exists()


def test_lab_without_root_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    def no_root():
        raise PermissionError("commwire lab needs root to create network namespaces and tc qdiscs; rerun with sudo")

    monkeypatch.setattr(commwire.lab, "require_tools", no_root)
    monkeypatch.setattr(suite, "run_part", lambda *a: pytest.fail("nothing may run"))
    assert suite.main(["--out", str(tmp_path / "r"), "--lab", "1gbit"]) == 1
    assert "rerun with sudo" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_progress_without_a_terminal_prints_one_line_per_event():
    out, err = io.StringIO(), io.StringIO()
    progress = suite.Progress(2, out=out, err=err)
    part = suite.plan(suite.SuiteConfig(out=".", only=("glm",)))[0]
    progress.start(0, part)
    progress.line("glm @ loopback", "| table |")
    progress.finish(0, _result("glm", "glm", "loopback", _glm_rows()))
    progress.finish(1, _result("glm", "glm", "lab 1gbit", [], rc=3, error="boom"))
    progress.close()
    assert out.getvalue() == "[glm @ loopback] | table |\n"
    assert err.getvalue().splitlines() == [
        "suite: [1/2] glm @ loopback: started",
        "suite: [1/2] glm @ loopback: ok in 1.5 s, 8 rows",
        "suite: [2/2] glm @ lab 1gbit: FAILED (exit 3) after 1.5 s: boom"]
    quiet = suite.Progress(1, quiet=True, out=out, err=io.StringIO())
    quiet.line("x", "hidden")
    quiet.close()
    assert "hidden" not in out.getvalue()


def test_progress_on_a_terminal_draws_a_rich_bar():
    err = io.StringIO()
    progress = suite.Progress(4, out=io.StringIO(), err=err, tty=True)
    progress.start(0, suite.plan(suite.SuiteConfig(out=".", only=("glm",)))[0])
    progress._bar.refresh()
    progress.close()
    text = err.getvalue()
    assert "\x1b[" in text and "suite" in text and "0/4" in text and "glm @ loopback" in text


@pytest.mark.mpi
@pytest.mark.slow
def test_quick_allreduce_suite_on_loopback_writes_rows(tmp_path):
    out = tmp_path / "suite"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "commwire", "bench", "suite", "--out", str(out), "--quick",
                           "--only", "allreduce", "--np", "2"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.monotonic() - start < 120
    data = json.loads((out / "suite.json").read_text())
    assert [(p["name"], p["where"], p["rc"]) for p in data["parts"]] == [
        ("allreduce fp32", "loopback", 0), ("allreduce codecs", "loopback", 0)]
    assert [r["bytes"] for r in data["parts"][0]["rows"]] == [65536, 1 << 20]
    assert {r["codec"] for r in data["parts"][1]["rows"]} == {"fp8-e4m3", "nvfp4"}
    assert all(r["ranks"] == 2 for p in data["parts"] for r in p["rows"])
    md = (out / "suite.md").read_text()
    assert "## allreduce codecs — loopback" in md and "| 1 MiB | nvfp4 | 2 |" in md
    assert "[allreduce fp32 @ loopback]" in proc.stdout  # streamed, prefixed
    assert "suite: [2/2] allreduce codecs @ loopback: ok" in proc.stderr  # no TTY: one line per event
    assert (out / "parts" / "01-allreduce-codecs-loopback.json").exists()
