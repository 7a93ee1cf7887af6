"""The horovod.torch API of commwire.torch on 1, 2 and 4 ranks — tier 2 (launches mpiexec)."""

from __future__ import annotations

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n,transport", [(1, "mpi"), (2, "mpi"), (4, "mpi"), (2, "torch")])
def test_horovod_api_suite(n, transport):
    run_mpi_pytest(n, "tests/torch/mpi_horovod.py", timeout=600, transport=transport)


def test_horovods_submodules_hold_the_names_code_imports_from_them():
    # horovod.torch.mpi_ops re-exports the lifecycle, introspection and process-set names (Horovod's
    # own tests and examples import rank, size, Sum, synchronize, ProcessSet ... from there).
    pytest.importorskip("torch")
    import commwire.torch as hvd
    from commwire.torch import compression, elastic, functions, mpi_ops, optimizer, sync_batch_norm

    names = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
             "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built",
             "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline",
             "stop_timeline", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet", "global_process_set",
             "add_process_set", "remove_process_set", "allreduce_async_", "grouped_allreduce_async_",
             "sparse_allreduce_async", "synchronize", "poll", "join", "reducescatter_async", "broadcast_async_"]
    assert [n for n in names if getattr(mpi_ops, n, None) is not getattr(hvd, n)] == []
    assert compression.Compression is hvd.Compression and functions.broadcast_object is hvd.broadcast_object
    assert optimizer.DistributedOptimizer is hvd.DistributedOptimizer
    assert sync_batch_norm.SyncBatchNorm is hvd.SyncBatchNorm
    assert elastic.TorchState and elastic.ElasticSampler and elastic.run
