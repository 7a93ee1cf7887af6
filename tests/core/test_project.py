"""`commwire bench project`: the cost model's projection to a cluster — tier 1 (single process)."""

import pytest

from commwire import costmodel as cm
from commwire.bench import project
from commwire.cli import main as cli_main


def test_projection_prints_a_row_per_node_count(capsys):
    assert project.main(["--nodes", "2,1024", "--bandwidth", "100gbit", "--latency", "5us", "--size", "4M",
                         "--codecs", "fp8-e4m3"]) == 0
    out = capsys.readouterr().out
    assert "| 2 |" in out and "| 1024 |" in out and "fp8-e4m3 speedup" in out


def test_projection_rows_are_the_cost_model_of_the_given_link():
    link = cm.LinkModel(alpha=5e-6, beta=8 / 100e9)
    text = project.projection(link, 4 << 20, [2, 16], [], "4M")
    rows = [line for line in text.splitlines() if line.startswith("| 2 |") or line.startswith("| 16 |")]
    assert [float(r.split("|")[2]) for r in rows] == pytest.approx(
        [cm.allreduce_seconds(link, 4 << 20, p) * 1e3 for p in (2, 16)], abs=0.006)


def test_latency_and_missing_link_values_are_refused(capsys):
    assert project.parse_latency("150us") == pytest.approx(150e-6)
    with pytest.raises(ValueError, match="like 5us"):
        project.parse_latency("fast")
    with pytest.raises(SystemExit):
        project.main(["--bandwidth", "100gbit"])
    assert "give both --bandwidth and --latency" in capsys.readouterr().err
    assert cli_main(["bench", "project", "--bandwidth", "1gbit", "--latency", "soon"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("commwire bench project: --latency: latency 'soon'") and err.count("\n") == 1
