"""The α–β cost model — tier 1 (single process; synthetic samples with known parameters)."""

import json

import pytest

from commwire.bench import project


def test_fit_recovers_alpha_and_beta_and_validates_exactly(tmp_path):
    truth = project.LinkModel(alpha=20e-6, beta=8e-9)
    samples = [(p, n, project.allreduce_seconds(truth, n, p)) for p in (2, 4, 8) for n in (16, 4096, 1 << 20, 1 << 24)]
    fitted = project.fit(samples[:4])  # two nodes only
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fitted.beta == pytest.approx(truth.beta, rel=1e-6)
    assert max(abs(r["error"]) for r in project.validate(fitted, samples)) < 1e-6
    path = tmp_path / "cal.json"
    path.write_text(json.dumps([{"ranks": p, "bytes": n, "raw_us": t * 1e6} for p, n, t in samples]))
    loaded = project._load([str(path)])
    assert [(p, n) for p, n, _ in loaded] == [(p, n) for p, n, _ in samples]
    assert [t for *_, t in loaded] == pytest.approx([t for *_, t in samples])


def test_compressed_model_approaches_the_byte_ratio_when_codecs_are_free():
    link = project.LinkModel(alpha=0.0, beta=8e-9)
    n = 64 << 20
    fp32 = project.allreduce_seconds(link, n, 8)
    fp8 = project.compressed_seconds(link, n, 8, wire_ratio=0.25, enc_Bps=1e18, dec_Bps=1e18)
    segments = n // project.PIPELINE_BYTES  # one segment of pipeline fill/drain on top of the wire time
    assert fp32 / fp8 == pytest.approx(4.0 / (1 + 1 / segments), rel=1e-6)
    # codec work hides behind the wire until it is the longer of the two
    slow = project.compressed_seconds(link, n, 8, wire_ratio=0.25, enc_Bps=1e8, dec_Bps=1e8)
    assert slow > fp8 and slow == pytest.approx((n / 1e8 + n * (2 - 1 / 8) / 1e8) * (1 + 1 / segments)
                                                 + fp8 / (1 + 1 / segments) / segments, rel=1e-6)


def test_core_sharing_terms_are_recovered_and_dropped_for_a_cluster():
    truth = project.LinkModel(alpha=15e-6, beta=8e-9, alpha_shared=50e-6, beta_shared=2e-9, cores=2)
    assert truth.sharing(2) == 0.0 and truth.sharing(8) == pytest.approx(0.75)
    samples = [(p, n, project.allreduce_seconds(truth, n, p)) for p in (2, 4) for n in (16, 1024, 1 << 16, 1 << 24)]
    fitted = project.fit(samples, cores=2)
    for name in ("alpha", "beta", "alpha_shared", "beta_shared"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    # predicts a node count it never saw
    assert project.allreduce_seconds(fitted, 1 << 20, 8) == pytest.approx(project.allreduce_seconds(truth, 1 << 20, 8))
    # without the cores the sharing terms cannot be fitted and are dropped; a cluster has none
    assert project.fit(samples).alpha_shared == 0.0
    alone = fitted.alone()
    assert alone.sharing(1024) == 0.0 and alone.alpha == fitted.alpha and alone.beta_shared == 0.0
    # recursive doubling below 2 KiB: log2 P rounds; reduce-scatter + all-gather above: 2 log2 P
    assert project._terms(16, 8) == (3.0, 48.0)
    assert project._terms(1 << 20, 8) == (6.0, 2 * 7 / 8 * (1 << 20))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least 2 samples"):
        project.fit([(2, 16, 1e-5)])
    with pytest.raises(ValueError, match="like 5us"):
        project._parse_latency("fast")
    with pytest.raises(ValueError, match="beta"):
        project.LinkModel(alpha=1e-6, beta=0.0)
    with pytest.raises(ValueError, match="cores=0"):
        project.LinkModel(alpha=1e-6, beta=1e-9, cores=0)


def test_projection_prints_a_row_per_node_count(capsys):
    assert project.main(["--nodes", "2,1024", "--bandwidth", "100gbit", "--latency", "5us", "--size", "4M",
                         "--codecs", "fp8-e4m3"]) == 0
    out = capsys.readouterr().out
    assert "| 2 |" in out and "| 1024 |" in out and "fp8-e4m3 speedup" in out
