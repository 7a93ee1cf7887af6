"""Hierarchical compressed all-reduce on 4 ranks — tier 2 (run under mpiexec by test_hierarchical.py).

Groups of 2 consecutive ranks stand in for nodes (one machine has one host).
References:
- integers whose every partial sum is exact in bf16: the bf16 result must equal numpy's
  integer sum bit for bit, whatever the grouping (a wrong block, offset or order shows);
- Gaussian data against the float64 sum, within the flat all-reduce's documented FP8
  bound (mpi_compressed.py: 0.06), results bit-identical on every rank;
- one group holding every rank: the float32 sum, no quantisation at all.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import commwire as cw
from commwire.codecs.collective import compressed_allreduce, last_wire_bytes
from commwire.codecs.hierarchical import hierarchy_setting, set_default_hierarchy

torch = pytest.importorskip("torch")

COMM = cw.init()
if COMM.size != 4:
    pytest.skip("written for 4 ranks (2 groups of 2)", allow_module_level=True)


def integers(n: int, rank: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).integers(-8, 9, size=n).astype(np.float32)


def gaussian(n: int, rank: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(n).astype(np.float32)


def same_everywhere(arr: np.ndarray) -> bool:
    return len(set(COMM.allgather_object(zlib.crc32(np.ascontiguousarray(arr).tobytes())))) == 1


@pytest.fixture(params=[None, 64 << 10], ids=["whole", "chunked"])
def chunks(request, monkeypatch):
    """Run whole, or with 64 KiB chunks: the across-group step of one overlaps the group steps of others."""
    from commwire.codecs import collective

    if request.param:
        monkeypatch.setattr(collective, "LEVEL_CHUNK_BYTES", request.param)
    return request.param


@pytest.mark.parametrize("n", [0, 1, 5, 128 * 2 + 3, 1000, 100_003])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_exact_where_bf16_is_exact(n, op, chunks):
    want = np.sum([integers(n, r).astype(np.float64) for r in range(COMM.size)], axis=0)
    want = want / COMM.size if op == "avg" else want
    got = compressed_allreduce(COMM, integers(n, COMM.rank), op, codec="bf16", name=f"exact{n}{op}{chunks}", hierarchical=2)
    assert got.dtype == np.float32 and got.shape == (n,)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_shapes_dtypes_kinds_and_out(chunks):
    x = integers(6 * 700, COMM.rank).reshape(6, 700)
    want = np.sum([integers(6 * 700, r) for r in range(COMM.size)], axis=0).reshape(6, 700)
    f64 = compressed_allreduce(COMM, x.astype(np.float64), codec="bf16", name="f64", hierarchical=2)
    assert f64.dtype == np.float64 and f64.shape == (6, 700)
    np.testing.assert_array_equal(f64, want)
    t = torch.from_numpy(x.copy())
    got = cw.allreduce(t, codec="bf16", name="torch", hierarchical=2)
    assert isinstance(got, torch.Tensor) and got.shape == (6, 700)
    np.testing.assert_array_equal(got.numpy(), want)
    compressed_allreduce(COMM, t, codec="bf16", out=t, name="torch", hierarchical=2)  # in place
    np.testing.assert_array_equal(t.numpy(), want)
    handle = cw.allreduce_async(x, codec="bf16", name="async", hierarchical=2)
    np.testing.assert_array_equal(handle.wait(), want)


@pytest.mark.parametrize("codec", ["fp8-e4m3", "ef+fp8-e4m3", "nvfp4"])
def test_gaussian_within_the_flat_bound(codec, chunks):
    n = 300_001
    want = np.sum([gaussian(n, r).astype(np.float64) for r in range(COMM.size)], axis=0)
    got = compressed_allreduce(COMM, gaussian(n, COMM.rank), codec=codec, name=f"g{codec}{chunks}", hierarchical=2)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert np.isfinite(got).all() and err < (0.2 if "nvfp4" in codec else 0.06), err
    assert same_everywhere(got)


def test_one_group_is_the_float32_sum():
    n = 50_000
    want = np.sum([gaussian(n, r).astype(np.float64) for r in range(COMM.size)], axis=0)
    got = compressed_allreduce(COMM, gaussian(n, COMM.rank), codec="fp8-e4m3", name="one", hierarchical=4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert last_wire_bytes() == 0  # nothing was encoded


def test_half_the_encoded_bytes_of_the_flat_all_reduce():
    x = gaussian(1 << 20, COMM.rank)
    compressed_allreduce(COMM, x, codec="fp8-e4m3", name="flatb", segment_bytes=1 << 20, hierarchical=False)
    flat = last_wire_bytes()
    compressed_allreduce(COMM, x, codec="fp8-e4m3", name="hierb", segment_bytes=1 << 20, hierarchical=2)
    hier = last_wire_bytes()
    # flat: 3 chunks of c/4 out, its reduced chunk once (c); hierarchical: the same over 2 ranks and c/2
    assert 0.45 < hier / flat < 0.55, (hier, flat)
    stats = cw.stats()  # the FP32 steps inside each group count as the group's own collectives
    assert stats["reduce_scatter"]["calls"] > 0 and stats["allgather"]["calls"] > 0, stats


def test_process_default_and_its_parsing(monkeypatch):
    x = gaussian(1 << 18, COMM.rank)
    try:
        set_default_hierarchy(2)
        cw.allreduce(x, codec="fp8-e4m3", name="dflt")
        hier = last_wire_bytes()
        set_default_hierarchy(False)
        cw.allreduce(x, codec="fp8-e4m3", name="dflt2")
        flat = last_wire_bytes()
        assert 0.45 < hier / flat < 0.55
        set_default_hierarchy(3)  # groups of 3 do not fit 4 ranks: the default falls back to flat, with a warning
        with pytest.warns(UserWarning, match="run flat: .*does not divide the 4 ranks"):
            cw.allreduce(x, codec="fp8-e4m3", name="dflt3")
        assert last_wire_bytes() == flat
    finally:
        set_default_hierarchy(None)
    assert hierarchy_setting(True) == ("node", True) and hierarchy_setting("3") == (3, True)
    assert hierarchy_setting(0) is None and hierarchy_setting("off") is None
    for bad in (1, -2, "nodes", 2.5):
        with pytest.raises(ValueError, match="not valid; use True or 'node'"):
            hierarchy_setting(bad)


def test_errors_reach_every_rank_and_the_next_call_works():
    x = gaussian(4096, COMM.rank)
    bad = x.astype(np.int32) if COMM.rank == 1 else x
    with pytest.raises(TypeError, match="needs a float array"):
        compressed_allreduce(COMM, bad, codec="fp8-e4m3", name="err", hierarchical=2)
    with pytest.raises(ValueError, match="does not divide the 4 ranks"):
        compressed_allreduce(COMM, x, codec="fp8-e4m3", name="err3", hierarchical=3)
    mine = 2 if COMM.rank == 0 else False  # rank 0 alone asks for groups: the signatures differ
    with pytest.raises(Exception, match="differ|mismatch"):
        compressed_allreduce(COMM, x, codec="fp8-e4m3", name="mixed", hierarchical=mine)
    with pytest.raises(ValueError, match="hierarchical='x' is not valid"):
        compressed_allreduce(COMM, x, codec="fp8-e4m3", name="err4", hierarchical="x" if COMM.rank == 3 else 2)
    want = np.sum([integers(4096, r) for r in range(COMM.size)], axis=0)
    got = compressed_allreduce(COMM, integers(4096, COMM.rank), codec="bf16", name="err", hierarchical=2)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("codec", ["bf16", "ef+fp8-e4m3"])
def test_device_path_matches_the_host_path(codec, chunks):
    # Inside cpu_standin torch CPU tensors take the device path (device buffers, codec kernels in torch):
    # every mode sends the same messages, so the results are bit-identical to the host path's.
    from commwire.comm import arrays

    x = gaussian(70_001, COMM.rank)
    host = compressed_allreduce(COMM, x, codec=codec, name=f"host{codec}{chunks}", hierarchical=2)
    with arrays.cpu_standin():
        t = torch.from_numpy(x.copy())
        dev = compressed_allreduce(COMM, t, codec=codec, name=f"dev{codec}{chunks}", hierarchical=2)
        compressed_allreduce(COMM, t, codec=codec, out=t, name=f"devin{codec}{chunks}", hierarchical=2)
    np.testing.assert_array_equal(dev.numpy(), host)
    np.testing.assert_array_equal(t.numpy(), host)
