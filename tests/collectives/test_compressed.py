"""Compressed all-reduce, reduce-scatter and all-gather on several ranks — tier 2 (launches mpiexec)."""

import pytest
from mpi_helpers import BOTH_TRANSPORTS, run_mpi_pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n,transport", BOTH_TRANSPORTS)
def test_compressed_allreduce_suite(n, transport):
    run_mpi_pytest(n, "tests/collectives/mpi_compressed.py", transport=transport)


@pytest.mark.parametrize("n,transport", BOTH_TRANSPORTS)
def test_compressed_reduce_scatter_and_allgather_suite(n, transport):
    run_mpi_pytest(n, "tests/collectives/mpi_sharded.py", transport=transport)


@pytest.mark.parametrize("n,seg,first,want", [
    # 1 MiB of FP32 on 4 ranks in 512 KiB segments: the 1024-element remainder joins the second segment
    (1 << 18, 512 << 10, None, [(0, 131072), (131072, 262144)]),
    # a remainder of half a segment or more stays a segment of its own
    (3 * 131072 + 65536, 512 << 10, None, [(0, 131072), (131072, 262144), (262144, 393216), (393216, 458752)]),
    # the capped first segment is never merged away, whatever follows it
    (1 << 18, 1 << 20, 512 << 10, [(0, 131072), (131072, 262144)]),
    ((1 << 18) + 512, 1 << 20, 512 << 10, [(0, 131072), (131072, 262656)]),
])
def test_segments_cover_the_tensor_without_a_short_last_segment(n, seg, first, want):
    from commwire.codecs.collective import ALIGN, segments

    got = segments(n, 4, seg, first)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == n and all(a[1] == b[0] for a, b in zip(got, got[1:]))
    assert all(a % (ALIGN * 4) == 0 for a, _ in got)  # whole quantisation blocks on every rank

