"""Choose how many CPU threads the codec kernels use.

Several MPI ranks usually share one node, and every rank runs its own kernels,
so letting each rank use every core oversubscribes the machine. The default is
therefore the cores this process may run on divided by the number of ranks on
the node, as announced by the launcher (``commwire.comm.rankenv``), and at least 1.
COMMWIRE_CODEC_THREADS overrides the default (the emulated cluster sets it:
there every "host" is a network namespace on the same cores, so the launcher's
per-node count is 1); :func:`set_threads` overrides both for the whole process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .. import _config
from .._validate import positive_int
from ..comm.rankenv import launcher_ranks

__all__ = ["get_threads", "set_threads", "blas_threads"]

_threads: int | None = None


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


_default: int | None = None


def default_threads() -> int:
    """Return the default thread count: COMMWIRE_CODEC_THREADS, else usable cores / ranks on this node.

    Worked out once per process (and again after ``set_threads(None)``): every codec
    kernel call asks, and reading the environment and the affinity mask costs more
    than encoding a small tensor.
    """
    global _default
    if _default is None:
        configured = _config.env_int("COMMWIRE_CODEC_THREADS", 0)  # 0: the default below
        _default = configured or max(1, _usable_cpus() // (launcher_ranks().local_size or 1))
    return _default


def get_threads() -> int:
    """Return the number of threads the CPU codec kernels use."""
    return _threads if _threads is not None else default_threads()


def set_threads(n: int | None) -> None:
    """Set the number of CPU threads for the codec kernels (None restores the default, read afresh)."""
    global _threads, _default
    positive_int("threads", n, allow_none=True)
    _threads = None if n is None else int(n)
    if n is None:
        _default = None


@contextlib.contextmanager
def blas_threads(n: int | None = None) -> Iterator[None]:
    """Limit BLAS to ``n`` threads inside the block (default: :func:`get_threads`, this rank's share).

    Every rank's BLAS otherwise starts a thread per core, and ranks sharing a node
    then fight over the cores, which slows a GEMM down by orders of magnitude. Needs
    threadpoolctl (a scikit-learn dependency); without it the BLAS keeps its default.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=n or get_threads(), user_api="blas"):
        yield
