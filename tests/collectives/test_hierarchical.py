"""Hierarchical compressed all-reduce: the blocks (tier 1) and the collective on 4 ranks (tier 2)."""

import numpy as np
import pytest
from mpi_helpers import run_mpi_pytest

from commwire.codecs.hierarchical import blocks


@pytest.mark.parametrize("n,parts", [(1, 2), (5, 2), (128 * 2 + 3, 2), (1000, 3), (100_003, 4), (256, 4)])
def test_blocks_cover_the_tensor_in_whole_quantisation_units(n, parts):
    counts = blocks(n, parts, 128)
    assert counts.sum() == n and len(counts) == parts and (counts >= 0).all()
    nonempty = np.flatnonzero(counts)
    assert all(counts[i] % 128 == 0 for i in nonempty[:-1])  # only the last block may hold a partial unit
    assert list(counts) == sorted(counts, reverse=True) or n % 128  # larger blocks first


@pytest.mark.mpi
@pytest.mark.parametrize("transport,only", [
    ("mpi", None),
    # over gloo the Gaussian and byte-count tests take 40 s on 2 cores: the exact, error and one-group tests run
    ("torch", "exact or errors or one_group or shapes"),
])
def test_hierarchical_allreduce_suite(transport, only):
    run_mpi_pytest(4, "tests/collectives/mpi_hierarchical.py", transport=transport, only=only)
